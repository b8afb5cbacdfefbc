"""The SGLang side of the plugin: the eviction strategy, the hooks, the admission gate and the
prefetch target. Each translates SGLang objects into calls on `state.PluginState` and the core
policies it holds, where the decisions are made. Imports sglang (0.5.23) and is only imported inside
an SGLang process (or a test that installed it).

Works on both of SGLang's Python trees: `UnifiedRadixCache` with the Python tree core (the default
tree; nodes are addressed by id) and the legacy `RadixCache` (nodes are objects). Prefetch needs
HiCache, which only the unified tree has.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.common import match_kv_cache
from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.radix_cache import RadixKey

from kvflow_ray.core.policies import ranks_by_agents
from kvflow_ray.core.prefetch import Load, PrefetchTarget, plan_loads, queued_need
from kvflow_ray.core.radix import Namespace
from kvflow_ray.core.snapshot import EngineSnapshot
from kvflow_ray.engines import metric_defs
from kvflow_ray.engines.sglang import protocol
from kvflow_ray.engines.sglang.state import logger, monotonic, path_to_root, radix_key, state

# ---------------------------------------------------------------------------------------- eviction


class KVFlowStrategy(EvictionStrategy):
    """`--radix-eviction-policy kvflow`: SGLang evicts the node with the smallest priority first, and
    the priority is the configured core eviction policy's (`kvflow` by default: farthest
    steps-to-execution first, untagged suffixes and retired workflows at +inf, then least recently
    used). `--radix-eviction-policy-config` JSON arrives here as keywords: `eviction`, `prefetch`,
    `admission` (registered policy names), `horizon`, `max_inflight` and the chosen policies' options
    (`state.make_policies`); a bad key or name fails SGLang's startup with a ValueError."""

    def __init__(self, **config: Any) -> None:
        self.state = state()
        self.state.configure(**config)

    def get_priority(self, node: Any) -> tuple[float, ...]:
        return self.state.priority(node)


def uses_kvflow(cache: Any) -> bool:
    """Whether this tree cache evicts with the kvflow strategy (the plugin stays out of the others)."""
    core = getattr(cache, "tree_core", None)
    strategy = getattr(core if core is not None else cache, "eviction_strategy", None)
    return isinstance(strategy, KVFlowStrategy)


def select_python_core(original: Any, params: Any) -> str:
    """AROUND `select_tree_core_backend`: SGLang's default Rust tree core knows only its built-in
    eviction policies, so a kvflow cache gets the Python core."""
    if getattr(params, "eviction_policy", None) == protocol.PLUGIN_NAME:
        chosen = params.tree_core_backend or None
        if chosen not in (None, "python"):
            logger.warning("kvflow: tree core %r cannot run the kvflow eviction policy; using 'python'", chosen)
        else:
            logger.info("kvflow: --radix-eviction-policy kvflow runs on the Python tree core")
        params.tree_core_backend = "python"
    return original(params)


# ------------------------------------------------------------------------------------------- tags


def _node(cache: Any, handle: Any) -> Any:
    """A tree node from what a cache API returned (the unified tree returns node ids)."""
    if isinstance(handle, int):
        return cache.tree_core.node_by_id(handle)
    return handle


def attached(cache: Any, node: Any) -> bool:
    """Whether `node` is still in the tree (eviction detaches a node without a host copy, but the
    Python object keeps its fields)."""
    core = getattr(cache, "tree_core", None)
    if core is not None:
        try:
            return core.node_by_id(node.id) is node
        except KeyError:
            return False
    parent = node.parent
    return parent is not None and any(child is node for child in parent.children.values())


def after_split_unified(result: Any, core: Any, key: Any, child: Any, split_len: int) -> None:
    """AFTER `UnifiedTreeCore._split_node`: it copies only the fields SGLang knows."""
    state().copy_tags(child, result[0])


def after_split_legacy(result: Any, cache: Any, key: Any, child: Any, split_len: int) -> None:
    """AFTER `RadixCache._split_node` (returns the new parent)."""
    state().copy_tags(child, result)


def stamp_fixed_prefix(cache: Any, tokens: Sequence[int], fixed_len: int, tag: protocol.Tag, *,
                       extra_key: Any = None, cache_salt: Any = None) -> list[Any]:
    """Tag the cached nodes of `tokens[:fixed_len]` (an agent's fixed prompt) with `tag`.

    The look-up splits the node the boundary falls in, so the dynamic rest stays untagged (that is
    what sends suffixes first); the boundary is rounded down to a page. Returns the tagged path."""
    page = max(int(getattr(cache, "page_size", 1)), 1)
    n = min(fixed_len, len(tokens)) // page * page
    if n <= 0:
        return []
    key = RadixKey(array("q", tokens[:n]), extra_key, cache_salt=cache_salt)
    match = cache.match_prefix(MatchPrefixParams(key=key))
    last = match.best_match_node if getattr(match, "best_match_node", None) is not None else match.last_device_node
    last = _node(cache, last)
    path = list(path_to_root(last))
    st = state()
    st.tag(path, tag)
    if path and sum(len(node.key) for node in path) == n:
        st.watch_boundary(path[0], tokens[:n])
    return path


def after_checkpoint(result: Any, cache: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `checkpoint(req, up_to=...)` (both trees): the request's KV is now in the tree; tag its
    fixed prompt with the request's (client id, agent) from `custom_params["kvflow"]`."""
    if not uses_kvflow(cache):
        return
    st = state()
    try:
        parsed = protocol.parse_request_params(getattr(req.sampling_params, "custom_params", None))
    except ValueError as exc:  # a bad request must not take the scheduler down: serve it untagged
        st.warn_once(f"bad-params:{exc}", f"kvflow: request {req.rid} served untagged: {exc}")
        return
    if parsed is None:
        return
    tag, explicit = parsed
    prompt = req.origin_input_ids
    up_to = kwargs.get("up_to", len(prompt))
    fixed = min(st.book.fixed_length(tag, prompt, explicit), up_to)
    salt = getattr(req, "cache_salt", None)
    path = stamp_fixed_prefix(cache, prompt, fixed, tag, extra_key=getattr(req, "extra_key", None), cache_salt=salt)
    if ranks_by_agents(st.eviction):  # the same prompt's agents in other live instances: their steps too
        for sharer in st.book.sharing(salt or "", prompt[:fixed]):
            st.tag(path, sharer)


# -------------------------------------------------------------------------------------- admission


class KVFlowPrefillAdder(PrefillAdder):
    """Admission on loading status (docs/design.md §3), as the configured admission policy says. A request
    whose cached prefix is still being copied in by a prefetch never joins a batch: SGLang's batch
    can only wait on loads it queued itself, and a prefetched node publishes its device indices
    before the copy ends. The scheduler polls until the copy lands (the request's stall). Meanwhile
    `batch_waits_for_loads` decides the rest of the pass: false (status-aware) passes over the request
    and keeps considering the ones behind it, so compute runs while the copy finishes; true (FCFS)
    ends the pass, so nothing behind it overtakes it."""

    def add_one_req(self, req: Any, has_chunked_req: bool, truncation_align_size: int | None) -> Any:
        st = state()
        last = _node(self.tree_cache, req.last_node) if req.last_node is not None else None
        now = monotonic()
        if last is not None and st.request_loading(last):
            st.held(req.rid, now)
            if st.admission.batch_waits_for_loads:
                return AddReqResult.OTHER  # ends the pass; what was admitted before it still runs
            return self.budget_state()  # not NO_TOKEN/OTHER: those end the pass for everyone
        device, host = req.prefix_len, getattr(req, "host_hit_length", 0)
        before = len(self.can_run_list)
        result = super().add_one_req(req, has_chunked_req, truncation_align_size)
        if len(self.can_run_list) > before:
            st.joined_batch(req)
            if last is not None:
                stall = st.admitted(req.rid, last, len(req.origin_input_ids), device, host, now)
                _observe_stall(stall)
        return result


def prefill_adder_class(scheduler: Any) -> type:
    """REPLACE `Scheduler.get_prefill_adder_class`."""
    return KVFlowPrefillAdder if uses_kvflow(scheduler.tree_cache) else PrefillAdder


def after_calc_priority(result: Any, policy: Any, waiting_queue: list[Any], *args: Any, **kwargs: Any) -> None:
    """AFTER `SchedulePolicy.calc_priority(waiting_queue, running_batch, processed_tokens)`, which the
    scheduler runs on its waiting queue before each prefill pass: the admission policy orders the
    queue (in place: the scheduler keeps the list object). Requests the policy leaves out of its
    order stay queued, behind the ones it chose, in SGLang's order.

    The policy hears of every request that joined or left the queue. One that keeps a view of the
    queue's prefixes (`queue-aware`, `lpm`: `pending`) gets each waiting request's cached prefix as
    SGLang's own cache-aware policies match it (`match_kv_cache`: device and host tokens), and the
    nodes those prefixes end at carry the queue's demand for the eviction policy."""
    cache = policy.tree_cache
    if not uses_kvflow(cache):
        return
    st = state()
    st.sync_queue(waiting_queue)
    pending = getattr(st.admission, "pending", None)
    if pending is not None:
        tracked = [req for req in waiting_queue if req in pending]  # the policy's window of the queue
        for req in tracked:
            match_kv_cache(req, cache)
            pending.set_cached(req, req.num_matched_prefix_tokens, req.prefix_len)
        st.mark_demand(_node(cache, req.last_node) for req in tracked if req.last_node is not None)
    if len(waiting_queue) < 2:
        return

    def is_loading(req: Any) -> bool:
        if req.last_node is None:
            return False
        try:
            return st.request_loading(_node(cache, req.last_node))
        except KeyError:  # the node left the tree since the request's last match: nothing loads there
            return False

    # a policy that tracks the queue reads it in arrival order; the others rank SGLang's own order
    queue = list(st.queued.values()) if pending is not None else waiting_queue
    ordered = list(st.admission.order(queue, [req for req in queue if not is_loading(req)]))
    chosen = {id(req) for req in ordered}
    waiting_queue[:] = [*ordered, *(req for req in waiting_queue if id(req) not in chosen)]


# --------------------------------------------------------------------------------- scheduler loop


def scheduler_apply_hints(scheduler: Any, payload: str) -> None:
    """`Scheduler.kvflow_apply_hints`, reached through `Engine.collective_rpc` on every rank; the
    cached nodes of the prompts it registers are tagged with their agents at once."""
    st = state()
    prompts = st.apply_hints(payload)
    cache = scheduler.tree_cache
    if uses_kvflow(cache) and ranks_by_agents(st.eviction):
        for tag, tokens, salt in st.book.registered(prompts):
            stamp_fixed_prefix(cache, tokens, len(tokens), tag, cache_salt=salt or None)


def before_next_batch(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE `Scheduler.get_next_batch_to_run`, once per scheduler iteration: settle finished
    prefetches, start new ones, publish status."""
    cache = scheduler.tree_cache
    if not uses_kvflow(cache):
        return
    st = state()
    st.settle_prefills()
    ongoing = getattr(cache, "ongoing_load_back", None)

    def is_attached(node: Any) -> bool:
        return attached(cache, node)

    st.reap(set(ongoing) if ongoing is not None else set(), is_attached)
    if st.prefetch_enabled and getattr(cache, "cache_controller", None) is not None:
        try:
            start_prefetches(cache, scheduler)
        except Exception:  # prefetch is an optimisation: never let it take the scheduler down
            logger.exception("kvflow: prefetch failed; prefetch is off for the rest of this process")
            st.prefetch_enabled = False
    st.check_boundaries(is_attached)
    # every TP rank holds the same tree and admits the same requests: rank 0 alone reports them
    st.reports = getattr(scheduler, "tp_rank", 0) == 0
    if not st.reports:
        return
    cache_tokens = _cache_tokens(cache)
    waiting, running = len(scheduler.waiting_queue), _running(scheduler)
    directory = os.environ.get(protocol.STATUS_DIR_ENV)
    if directory:
        try:
            st.write_status(directory, lambda: st.snapshot(waiting, running, cache_tokens), monotonic())
        except OSError as exc:
            st.warn_once(f"status:{exc}", f"kvflow: cannot write status to {directory}: {exc}")
    _export_metrics(st, waiting, running, cache_tokens)


@dataclass
class SGLangPrefetchTarget:
    """`core.prefetch.PrefetchTarget` on SGLang's unified tree with HiCache: finds an agent's prompt
    on the host tier and starts its load-back when it fits the budget (core.prefetch's rule: free
    device tokens plus tokens evictable without touching anything needed by step `steps`, minus
    `reserved`)."""

    cache: Any  # UnifiedRadixCache with a cache_controller

    def load_prompt(self, tag: protocol.Tag, tokens: Sequence[int], namespace: Namespace, steps: float,
                    reserved: int) -> Load:
        cache, st = self.cache, state()
        page = max(int(cache.page_size), 1)
        n = len(tokens) // page * page
        if n <= 0:
            return Load.NOTHING
        # in the workflow's namespace: its requests carry this salt, so only that copy serves them
        match = cache.match_prefix(MatchPrefixParams(key=radix_key(tokens[:n], namespace)))
        if match.host_hit_length <= 0:
            return Load.NOTHING  # on the device already, loading, or not cached anywhere
        anchor = _node(cache, match.best_match_node)
        nodes = [node for node in path_to_root(anchor) if node.evicted]
        need = sum(len(node.key) for node in nodes)
        budget = (cache.token_to_kv_pool_allocator.available_size()
                  + st.farther_evictable(cache.tree_core.root_node, steps) - reserved)
        if not cache.has_free_load_back_slot() or need > budget or not cache.load_back(anchor.id, mem_quota=budget):
            return Load.NO_ROOM
        cache.ready_to_load_host_cache()  # start the copy now, overlapped with the running batch
        st.loading_started(tag, anchor, nodes, need, monotonic())
        return Load.STARTED


def start_prefetches(cache: Any, scheduler: Any, target: PrefetchTarget | None = None) -> int:
    """`core.prefetch.plan_loads` with the plugin's prefetch policy over `target` (the cache's
    `SGLangPrefetchTarget` unless given), keeping room for what the waiting requests still need.
    Returns the number of loads started."""
    st = state()
    reserved = queued_need((len(r.origin_input_ids), r.prefix_len, r.sampling_params.max_new_tokens or 0)
                           for r in scheduler.waiting_queue)
    return plan_loads(st.prefetcher, st.book, len(st.loading), target or SGLangPrefetchTarget(cache), reserved)


def _running(scheduler: Any) -> int:
    batch = getattr(scheduler, "running_batch", None)
    return len(batch.reqs) if batch is not None and getattr(batch, "reqs", None) is not None else 0


def _cache_tokens(cache: Any) -> dict[str, int]:
    tokens = {"gpu": int(cache.evictable_size()) + int(cache.protected_size())}
    controller = getattr(cache, "cache_controller", None)
    host = getattr(controller, "mem_pool_host", None)
    if host is not None and hasattr(host, "size") and hasattr(host, "available_size"):
        tokens["cpu"] = int(host.size - host.available_size())
    return tokens


# ---------------------------------------------------------------------------------------- metrics
# The engine metrics of `engines.metric_defs`, the definitions the serving layer exports too.
# Created lazily in the scheduler process: SGLang runs prometheus_client in multiprocess mode, set
# up only after plugins load (a metric built earlier would keep single-process storage). Without
# --enable-metrics there is no PROMETHEUS_MULTIPROC_DIR and nothing is exported.
# SGLang's `/metrics` reads only the values that processes wrote to their multiprocess files, never
# a collector registered in a scheduler process, so nothing here can be computed at scrape time:
# every scheduler iteration feeds the plugin's snapshot through `SnapshotFeed` (counters advance to
# its cumulative totals), the stall histogram is observed at each admission.

# SGLang's tree evicts without the plugin seeing it, so the plugin's snapshot has no eviction counts.
PLUGIN_METRICS = tuple(d for d in metric_defs.ENGINE_METRICS if d is not metric_defs.EVICTED_TOKENS)

_feed: metric_defs.SnapshotFeed | None = None


def _metric_feed() -> metric_defs.SnapshotFeed | None:
    global _feed
    if _feed is None and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        _feed = metric_defs.SnapshotFeed({d: metric_defs.make_metric(d) for d in PLUGIN_METRICS})
    return _feed


def _observe_stall(stall: float) -> None:
    """Every admitted request, 0 included, as the serving layer observes every result."""
    feed = _metric_feed()
    if feed is not None and state().reports:
        feed.metrics[metric_defs.PREFETCH_STALL].observe(stall)


def _export_metrics(st: Any, waiting: int, running: int, cache_tokens: dict[str, int]) -> None:
    feed = _metric_feed()
    if feed is not None:
        feed.feed(EngineSnapshot.from_dict(st.snapshot(waiting, running, cache_tokens)))
