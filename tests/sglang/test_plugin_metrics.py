"""The plugin's metrics (docs/design.md §9) reach SGLang's `/metrics`: SGLang runs prometheus_client in
multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, set before its scheduler processes start) and its
`/metrics` is a `MultiProcessCollector` over that directory. The scenario runs in a fresh process
with the directory set, as a scheduler does; this test then reads the directory the way SGLang's
`/metrics` does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).parent

SCENARIO = f"""
import sys
sys.path[:0] = [{str(HERE)!r}]
import conftest
from types import SimpleNamespace
from array import array
from kvflow_ray.engines.sglang import plugin, hooks
plugin.register()
from sglang.srt.plugins.hook_registry import HookRegistry
HookRegistry.apply_hooks()
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=1, radix_eviction_policy="kvflow"))
import sglang_caches as sc
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from kvflow_ray.engines.sglang.state import state
rig = sc.build("unified", "kvflow")
prompt = list(range(100, 200))
rig.serve(prompt, "c1", "a", fixed=100)
req = Req(rid="r", origin_input_text="", origin_input_ids=array("q", prompt + [1, 2, 3, 4, 5]),
          sampling_params=SamplingParams(max_new_tokens=2))
req.init_next_round_input(rig.cache)
scheduler = SimpleNamespace(tree_cache=rig.cache, waiting_queue=[req], running_batch=None, tp_rank=0)
state().loading_ids.add(rig.node(req.last_node).id)
adder = Scheduler.get_prefill_adder_class(scheduler)(1, rig.cache, rig.allocator, None, 1.0, 10_000, 10_000)
adder.add_one_req(req, False, None)  # held: its prompt is loading
hooks.before_next_batch(scheduler)
state().loading_ids.clear()
adder = Scheduler.get_prefill_adder_class(scheduler)(1, rig.cache, rig.allocator, None, 1.0, 10_000, 10_000)
adder.add_one_req(req, False, None)  # admitted after its stall
scheduler.waiting_queue = []
hooks.before_next_batch(scheduler)
"""


def test_plugin_metrics_are_exported_through_sglangs_multiprocess_registry(tmp_path: Path) -> None:
    env = {**__import__("os").environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))  # SGLang's /metrics does this
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(generate_latest(registry).decode())
               for s in family.samples}
    assert samples[("kvflow_prompt_tokens_total", (("tier", "gpu"),))] == 100
    assert samples[("kvflow_prompt_tokens_total", (("tier", "miss"),))] == 5
    assert samples[("kvflow_prompt_tokens_total", (("tier", "cpu"),))] == 0
    assert samples[("kvflow_prefetch_stall_seconds_count", ())] == 1
    assert samples[("kvflow_prefetch_stall_seconds_sum", ())] > 0
    assert samples[("kvflow_queue_length", ())] == 0
    assert samples[("kvflow_cache_tokens", (("tier", "gpu"),))] == 100  # the prompt (the admitted call has not run)
    assert ("kvflow_prefetch_total", (("outcome", "issued"),)) in samples
