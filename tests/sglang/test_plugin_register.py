"""How SGLang finds and runs the plugin: its entry point, its CLI choice, the tree core it needs,
its control path and its status output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import sglang_caches as sc

from kvflow_ray.core.routing import block_hashes
from kvflow_ray.engines.sglang import hooks, plugin, protocol
from kvflow_ray.engines.sglang.state import reset_state, state

HERE = Path(__file__).parent


def test_sglangs_own_loader_finds_and_installs_the_plugin() -> None:
    """In a fresh process, SGLang's `load_plugins()` (what every SGLang process runs at start) finds
    the entry point of the installed package and installs everything."""
    code = f"""
import sys, json
sys.path[:0] = [{str(HERE)!r}]
import conftest  # the torchvision stand-in
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES
from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.unified_cache.tree_core_registry import select_tree_core_backend
from types import SimpleNamespace
kvflow_cache = SimpleNamespace(eviction_strategy=_EVICTION_POLICY_FACTORIES["kvflow"]())
print(json.dumps({{
    "factory": _EVICTION_POLICY_FACTORIES["kvflow"].__qualname__,
    "choice": "kvflow" in RADIX_EVICTION_POLICY_CHOICES,
    "rpc": hasattr(Scheduler, "kvflow_apply_hints"),
    "adder": Scheduler.get_prefill_adder_class(SimpleNamespace(tree_cache=kvflow_cache)).__name__,
    "core": select_tree_core_backend(CacheInitParams(disable=False, req_to_token_pool=None,
        token_to_kv_pool_allocator=None, page_size=1, eviction_policy="kvflow")),
}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["factory"] == "KVFlowStrategy"
    assert out["choice"] and out["rpc"]
    assert out["adder"] == "KVFlowPrefillAdder" and out["core"] == "python", "the hooks are installed"


def test_register_is_idempotent(sglang_plugin: None) -> None:
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES

    plugin.register()
    plugin.register()
    assert RADIX_EVICTION_POLICY_CHOICES.count("kvflow") == 1


def test_kvflow_is_a_cli_choice(sglang_plugin: None) -> None:
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "dummy", "--radix-eviction-policy", "kvflow",
                                "--radix-eviction-policy-config", '{"horizon": 2}'])
    assert args.radix_eviction_policy == "kvflow"


def test_kvflow_gets_the_python_tree_core_and_other_policies_keep_the_default(
        sglang_plugin: None, caplog: pytest.LogCaptureFixture) -> None:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import select_tree_core_backend

    def params(policy: str) -> CacheInitParams:
        return CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                               page_size=1, eviction_policy=policy)

    default = select_tree_core_backend(params("lru"))
    assert default == "rust", "SGLang's default (torch 2.13 on Linux) is unchanged for other policies"
    with caplog.at_level("INFO", logger="kvflow_ray.sglang"):
        assert select_tree_core_backend(params("kvflow")) == "python"
    assert "Python tree core" in caplog.text
    reset_state()
    rig = sc.build("unified", "kvflow")  # built with no tree_core_backend at all
    assert type(rig.cache.tree_core).__name__ == "UnifiedTreeCore"
    assert hooks.uses_kvflow(rig.cache)


def test_the_strategy_takes_its_config_from_the_cli_json(sglang_plugin: None) -> None:
    from sglang.srt.mem_cache.utils import get_eviction_strategy

    from kvflow_ray.core.admission import FCFSAdmission, LongestPrefixStatusAware
    from kvflow_ray.core.policies import KVFlowPolicy, LRUPolicy
    from kvflow_ray.core.prefetch import NoPrefetch, StepsAheadPrefetch

    reset_state()
    strategy = get_eviction_strategy("kvflow", {"horizon": 2, "max_inflight": 3})
    assert isinstance(strategy, hooks.KVFlowStrategy)
    st = state()
    assert isinstance(st.eviction, KVFlowPolicy) and isinstance(st.admission, LongestPrefixStatusAware)
    assert isinstance(st.prefetcher, StepsAheadPrefetch)
    assert (st.prefetcher.horizon, st.prefetcher.max_inflight) == (2, 3)

    get_eviction_strategy("kvflow", {"eviction": "lru", "prefetch": "none", "admission": "fcfs"})
    st = state()
    assert isinstance(st.eviction, LRUPolicy) and isinstance(st.prefetcher, NoPrefetch)
    assert isinstance(st.admission, FCFSAdmission)
    # the old boolean form: prefetch false = none (its horizon and max_inflight are still accepted)
    get_eviction_strategy("kvflow", {"horizon": 1, "max_inflight": 4, "prefetch": False})
    assert isinstance(state().prefetcher, NoPrefetch)
    get_eviction_strategy("kvflow", {"prefetch": True})
    assert isinstance(state().prefetcher, StepsAheadPrefetch)


def test_the_predictive_policy_reaches_the_plugin(sglang_plugin: None) -> None:
    """`policy: predictive` on the SGLang engine: kvflow's eviction over the router's expected steps,
    likely-next prefetch (a speculative load takes free or retired memory only), in the book's reach."""
    from sglang.srt.mem_cache.utils import get_eviction_strategy

    from kvflow_ray.core.prefetch import NEVER_NEEDED, LikelyNextPrefetch
    from kvflow_ray.core.scheduler import POLICIES
    from kvflow_ray.engines.sglang.engine import PLUGIN_CONFIG, policy_server_args

    args = policy_server_args(POLICIES["predictive"])
    assert args[PLUGIN_CONFIG] == {"eviction": "kvflow", "prefetch": "likely-next", "admission": "lpm-status-aware"}
    reset_state()
    get_eviction_strategy("kvflow", {"eviction": "kvflow", "prefetch": "likely-next", "horizon": 2})
    st = state()
    assert isinstance(st.prefetcher, LikelyNextPrefetch)
    assert st.book.near_horizon >= st.prefetcher.horizon > 2
    assert st.prefetcher.room_beyond(2.0) == 2.0 and st.prefetcher.room_beyond(2.5) == NEVER_NEEDED


@pytest.mark.parametrize(("config", "message"), [
    ({"horizn": 2}, r"unknown key\(s\) horizn \(accepted: eviction, prefetch, admission, horizon, max_inflight"),
    ({"eviction": "lfu"}, r"unknown eviction policy 'lfu' \(known: lru, kvflow, belady"),
    ({"prefetch": "always"}, r"unknown prefetch policy 'always' \(known: none, steps-ahead"),
    ({"admission": "sjf"}, r"unknown admission policy 'sjf' \(known: fcfs, status-aware"),
    ({"horizon": -1}, "horizon >= 0"),
])
def test_a_bad_config_fails_startup_naming_what_is_accepted(sglang_plugin: None, config: dict,
                                                            message: str) -> None:
    from sglang.srt.mem_cache.utils import get_eviction_strategy

    reset_state()
    with pytest.raises(ValueError, match=message):
        get_eviction_strategy("kvflow", config)


def test_hints_reach_the_policy_and_bad_payloads_are_rejected(sglang_plugin: None) -> None:
    reset_state()
    rig = sc.build("unified", "kvflow")  # `rig.hints` calls the method on its scheduler
    apply = rig.hints
    apply(protocol.encode_hints({"c1": {"a": 0, "b": float("inf")}}, {("c1", "a"): [1, 2, 3]}))
    st = state()
    assert st.book.steps(("c1", "a")) == 0 and st.book.steps(("c1", "b")) == float("inf")
    assert st.book.prompt(("c1", "a")) == (1, 2, 3)
    apply(protocol.encode_hints(retire=["c1"]))
    assert st.book.steps(("c1", "a")) == float("inf")
    # collective_rpc turns the exception into its failure message for the caller
    with pytest.raises(ValueError, match="malformed kvflow hints payload"):
        apply('{"steps": {"c1": 5}}')
    with pytest.raises(ValueError, match="malformed kvflow hints payload"):
        apply("not json")


def test_each_scheduler_iteration_publishes_status(sglang_plugin: None, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from kvflow_ray.engines.base import prefix_hash

    monkeypatch.setenv(protocol.STATUS_DIR_ENV, str(tmp_path))
    reset_state()
    rig = sc.build("unified", "kvflow")
    fixed = list(range(100, 140))
    rig.serve([*fixed, 1, 2, 3], "c1", "a", fixed=len(fixed))
    scheduler = SimpleNamespace(tree_cache=rig.cache, waiting_queue=[], running_batch=None, tp_rank=0)
    hooks.before_next_batch(scheduler)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["cache_tokens"]["gpu"] == 43
    assert set(stats) >= {"waiting", "running", "prompt_tokens", "prefetch", "prefetch_stall_s"}
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    blocks = list(block_hashes(fixed))  # the router's block index learns the prompt's blocks (2 of 16 tokens)
    assert len(blocks) == 2
    assert events == [{"kind": "stored", "tier": "gpu", "prefix_hash": prefix_hash(fixed), "tokens": 40,
                       "blocks": blocks}]

    rig.evict(1000)
    state()._status_at = 0.0  # next interval
    hooks.before_next_batch(scheduler)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events[-1] == {"kind": "removed", "tier": "gpu", "prefix_hash": prefix_hash(fixed), "tokens": 40,
                          "blocks": blocks}
    assert json.loads((tmp_path / "stats.json").read_text())["cache_tokens"]["gpu"] == 0
