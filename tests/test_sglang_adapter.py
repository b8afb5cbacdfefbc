"""The SGLang engine adapter's parts that run without SGLang or a GPU: requests to sampling params (with the
plugin's custom_params), SGLang's meta_info to GenerateResult, the plugin's status files (events.jsonl
tailing, stats.json), server args per policy, `engine: sglang` in the app config and deploy/serve-sglang.yaml,
and the GPU smoke script's model config, driver (over the simulator's serving engine) and JSON result.
What needs SGLang's engine itself (CUDA) is benchmarks/sglang_smoke.py, run by deploy/gpu-smoke.sh."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from kvflow_ray.engines.base import CacheEvent, GenerateRequest, Hints
from kvflow_ray.engines.sglang import protocol
from kvflow_ray.engines.sglang.engine import (
    SglangEngine,
    SglangRequest,
    build_server_args,
    empty_snapshot,
    finish_reason,
    generate_kwargs,
    merge_stats,
    new_output_tokens,
    parse_event,
    plugin_registered,
    read_events,
    read_status,
    result_from_output,
    sampling_params,
    tier_split,
)
from kvflow_ray.engines.sim.simulator import IterationRecord
from kvflow_ray.serve.config import AppConfig
from kvflow_ray.serve.metrics import ReplicaMetrics

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "benchmarks" / "sglang_smoke.py"
RESULT_KEYS = {"latency_s", "p99_latency_s", "gpu_hit_ratio", "cpu_hit_ratio", "recomputed_tokens",
               "loaded_tokens", "prefetch_stall_s"}


def _load_smoke() -> Any:
    spec = importlib.util.spec_from_file_location("sglang_smoke", SMOKE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sglang_smoke"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


smoke = _load_smoke()


# ---------------------------------------------------------------------------------------------- requests
def test_a_plain_request_has_no_custom_params() -> None:
    params = sampling_params(GenerateRequest(tokens=[1, 2, 3], max_tokens=7, temperature=0.0, seed=5))
    assert params == {"max_new_tokens": 7, "temperature": 0.0, "top_p": 1.0, "ignore_eos": False}  # greedy: no seed


def test_top_p_and_stop_strings_travel_as_sglangs_own() -> None:
    request = GenerateRequest(tokens=[1, 2, 3], max_tokens=7, temperature=0.7, top_p=0.9, stop=["###", "\n\n"])
    params = sampling_params(request)
    assert params["top_p"] == 0.9 and params["stop"] == ["###", "\n\n"]
    assert "stop" not in sampling_params(GenerateRequest(tokens=[1], stop=()))  # none: SGLang's default
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed: the names are not checked against its SamplingParams")
    # SGLang's own SamplingParams takes them under these names (in a subprocess: importing sglang
    # patches transformers for the whole process)
    check = ("import json, sys\n"
             "from sglang.srt.sampling.sampling_params import SamplingParams\n"
             "p = SamplingParams(**json.loads(sys.argv[1]))\n"
             "p.verify(1000)\n"
             "print(json.dumps({'top_p': p.top_p, 'stop_strs': p.stop_strs}))\n")
    out = subprocess.run([sys.executable, "-c", check, json.dumps(params)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"top_p": 0.9, "stop_strs": ["###", "\n\n"]}


def test_workflow_metadata_travels_flat_in_custom_params() -> None:
    request = GenerateRequest(tokens=list(range(20)), max_tokens=4, temperature=0.7, seed=3, ignore_eos=True,
                              workflow="acme/c1", agent="planner", fixed_prefix_tokens=12)
    params = sampling_params(request)
    assert params["max_new_tokens"] == 4 and params["ignore_eos"] is True and params["sampling_seed"] == 3
    assert params["custom_params"] == {"kvflow": {"client_id": "acme/c1", "agent": "planner",
                                                  "fixed_prefix_tokens": 12}}
    # what the plugin reads back (and nothing nested: SGLang's msgpack IPC refuses nested values)
    assert protocol.parse_request_params(params["custom_params"]) == (("acme/c1", "planner"), 12)
    assert all(not isinstance(v, dict) for v in params["custom_params"]["kvflow"].values())
    no_boundary = sampling_params(GenerateRequest(tokens=[1], workflow="w", agent="a"))
    assert no_boundary["custom_params"] == {"kvflow": {"client_id": "w", "agent": "a"}}


@pytest.mark.parametrize(("params", "message"), [
    ({"client_id": "", "agent": "a"}, "custom_params.kvflow.client_id must be a non-empty string"),
    ({"client_id": "c", "agent": 3}, "custom_params.kvflow.agent must be a non-empty string"),
    ({"client_id": "c", "agent": "a", "fixed_prefix_tokens": -1}, "fixed_prefix_tokens must be a non-negative"),
    ({"client_id": "c", "agent": "a", "fixed_prefix_tokens": True}, "fixed_prefix_tokens must be a non-negative"),
    ({"client_id": "c", "agent": "a", "tenant": "t"}, r"unknown key\(s\) \['tenant'\]"),
])
def test_plugin_params_follow_the_shared_metadata_rule(params: dict[str, Any], message: str) -> None:
    # the same rule (engines.base.meta_problem) the OpenAI door and every engine apply
    with pytest.raises(ValueError, match=message):
        protocol.parse_request_params({"kvflow": params})
    assert protocol.parse_request_params(None) is None and protocol.parse_request_params({"other": 1}) is None


def test_the_cache_salt_travels_as_sglangs_own_cache_salt() -> None:
    """SGLang 0.5.23 namespaces its radix tree by `async_generate(cache_salt=...)`; the default namespace
    sends none (SGLang treats "" as none too). Hints carry each workflow's salt to the plugin."""
    salted = SglangRequest(rid="kvflow-1", tokens=(1, 2, 3), params={"max_new_tokens": 2}, cache_salt="tenant-a")
    assert generate_kwargs(salted) == {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2},
                                       "stream": True, "rid": "kvflow-1", "cache_salt": "tenant-a"}
    plain = SglangRequest(rid="kvflow-2", tokens=(1, 2, 3), params={})
    assert "cache_salt" not in generate_kwargs(plain)
    payload = protocol.encode_hints({"c1": {"a": 0}}, {("c1", "a"): [1, 2]}, ["c0"], {"c1": "tenant-a"}, {"c1": ["b"]})
    assert protocol.decode_hints(payload) == ({"c1": {"a": 0.0}}, {("c1", "a"): (1, 2)}, ["c0"],
                                              {"c1": "tenant-a"}, {"c1": ["b"]})
    assert protocol.decode_hints(protocol.encode_hints())[3] == {}


# ---------------------------------------------------------------------------------------------- results
def test_meta_info_splits_prompt_tokens_by_tier() -> None:
    meta = {"prompt_tokens": 100, "cached_tokens": 70, "cached_tokens_details": {"device": 40, "host": 30},
            "finish_reason": {"type": "length", "length": 3}}
    result = result_from_output([5, 6, 7], meta, prompt_tokens=100, text="abc", ttft_s=0.1, latency_s=0.3)
    assert (result.gpu_hit_tokens, result.cpu_hit_tokens, result.miss_tokens) == (40, 30, 30)
    assert result.tokens == [5, 6, 7] and result.text == "abc" and result.prompt_tokens == 100
    assert result.finish_reason == "length" and result.stall_s == 0.0
    assert (result.ttft_s, result.latency_s) == (0.1, 0.3)


def test_meta_info_without_details_or_cache() -> None:
    # no host tier: SGLang leaves the breakdown out and every cached token is a device hit
    assert tier_split({"cached_tokens": 64}, 100) == (64, 0, 36)
    assert tier_split({"cached_tokens": 64, "cached_tokens_details": None}, 100) == (64, 0, 36)
    assert tier_split({}, 100) == (0, 0, 100)  # nothing cached: SGLang sends neither
    # storage (L3) hits came through the host tier
    assert tier_split({"cached_tokens_details": {"device": 10, "host": 5, "storage": 5}}, 40) == (10, 10, 20)
    # never more hits than prompt tokens
    assert tier_split({"cached_tokens_details": {"device": 90, "host": 30}}, 100) == (90, 10, 0)
    # prompt_tokens as sent, when SGLang does not echo it
    result = result_from_output([1], {"finish_reason": {"type": "stop", "matched": 2}}, prompt_tokens=9,
                                text="", ttft_s=0.0, latency_s=0.0)
    assert result.prompt_tokens == 9 and result.miss_tokens == 9 and result.finish_reason == "stop"


def test_aborted_requests_raise() -> None:
    with pytest.raises(ValueError, match="too long"):
        finish_reason({"finish_reason": {"type": "abort", "message": "too long", "status_code": 400}})
    with pytest.raises(RuntimeError, match="out of memory"):
        finish_reason({"finish_reason": {"type": "abort", "message": "out of memory", "status_code": 500}})
    assert finish_reason({"finish_reason": None}) == "length"  # unfinished chunk


def test_stream_chunks_cumulative_or_incremental() -> None:
    # default: every chunk carries the whole output so far
    assert new_output_tokens({"output_ids": [1, 2, 3]}, 1, incremental=False) == [2, 3]
    assert new_output_tokens({"output_ids": [1, 2, 3]}, 3, incremental=False) == []
    # --incremental-streaming-output: deltas
    assert new_output_tokens({"output_ids": [4]}, 3, incremental=True) == [4]
    assert new_output_tokens({"meta_info": {}}, 3, incremental=False) == []


# ---------------------------------------------------------------------------------------------- status files
def _line(kind: str, tier: str, prefix: str, tokens: int) -> str:
    return json.dumps({"kind": kind, "tier": tier, "prefix_hash": prefix, "tokens": tokens}) + "\n"


def test_events_are_tailed_whole_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    assert read_events(path, 0) == ([], 0)  # the plugin has not written yet
    path.write_text(_line("stored", "gpu", "aa", 8) + _line("stored", "cpu", "bb", 4) + '{"kind": "rem')
    events, offset = read_events(path, 0)
    assert events == [CacheEvent("stored", "gpu", "aa", 8), CacheEvent("stored", "cpu", "bb", 4)]
    assert read_events(path, offset) == ([], offset)  # the partial line waits
    with path.open("a") as f:  # the writer finishes its line, then writes one the reader cannot use
        f.write('oved", "tier": "gpu", "prefix_hash": "aa", "tokens": 8}\n')
        f.write("not json\n" + json.dumps({"kind": "moved", "tier": "gpu", "prefix_hash": "x", "tokens": 1}) + "\n")
        f.write(_line("removed", "cpu", "bb", 4))
    events, offset2 = read_events(path, offset)
    assert events == [CacheEvent("removed", "gpu", "aa", 8), CacheEvent("removed", "cpu", "bb", 4)]
    assert offset2 == path.stat().st_size
    # a restarted scheduler starts a new file: read it from its start
    path.write_text(_line("stored", "gpu", "cc", 2))
    assert read_events(path, offset2) == ([CacheEvent("stored", "gpu", "cc", 2)], path.stat().st_size)


def test_event_records_are_checked() -> None:
    assert parse_event({"kind": "stored", "tier": "gpu", "prefix_hash": "a", "tokens": 3}) is not None
    event = parse_event({"kind": "stored", "tier": "gpu", "prefix_hash": "a", "tokens": 40, "blocks": [7, -9]})
    assert event is not None and event.blocks == (7, -9)
    for bad in ([1, 2], {"kind": "stored", "tier": "disk", "prefix_hash": "a", "tokens": 3},
                {"kind": "stored", "tier": "gpu", "prefix_hash": "", "tokens": 3},
                {"kind": "stored", "tier": "gpu", "prefix_hash": "a", "tokens": True},
                {"kind": "stored", "tier": "gpu", "prefix_hash": "a", "tokens": -1},
                # more blocks than the prompt has, a block hash that is no 64-bit int
                {"kind": "stored", "tier": "gpu", "prefix_hash": "a", "tokens": 20, "blocks": [1, 2]},
                {"kind": "stored", "tier": "gpu", "prefix_hash": "a", "tokens": 40, "blocks": [1 << 70]},
                {"kind": "stored", "tier": "gpu", "prefix_hash": "a", "tokens": 40, "blocks": ["x"]}):
        assert parse_event(bad) is None


def test_stats_merge_the_plugin_status_over_the_adapter_counts(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    assert read_status(path) is None
    path.write_text("{not json")
    assert read_status(path) is None
    path.write_text(json.dumps({"waiting": 2, "running": 1, "loaded_tokens": 512,
                                "prefetch": {"issued": 3, "used": 2},
                                "evicted_tokens": {"gpu": 100, "written_back": 60},
                                "cache_tokens": {"gpu": 900, "cpu": 4000}}))
    status = read_status(path)
    own = {"running": 5, "prompt_tokens": {"gpu": 10, "cpu": 20, "miss": 30}, "capacity_tokens": {"gpu": 1000}}
    stats = merge_stats(status, own)
    assert set(stats) == set(empty_snapshot())
    assert stats["running"] == 1 and stats["waiting"] == 2  # the scheduler's view wins
    assert stats["prompt_tokens"] == {"gpu": 10, "cpu": 20, "miss": 30}  # the plugin left them out
    assert stats["prefetch"] == {"issued": 3, "completed": 0, "used": 2, "wasted": 0}
    assert stats["evicted_tokens"] == {"gpu": 100, "cpu": 0, "written_back": 60, "dropped": 0}
    assert stats["capacity_tokens"] == {"gpu": 1000, "cpu": 0}
    assert merge_stats({"prompt_tokens": {"gpu": 1}}, own)["prompt_tokens"] == {"gpu": 1, "cpu": 20, "miss": 30}
    # the replica's metrics read every key they need from it, with or without a plugin status
    metrics = ReplicaMetrics("r0")
    metrics.observe_stats(stats)
    metrics.observe_stats(merge_stats(None, own))
    assert b'kvflow_cache_tokens{replica="r0",tier="cpu"} 0.0' in metrics.exposition()


# ---------------------------------------------------------------------------------------------- server args
def test_server_args_per_policy() -> None:
    lru = build_server_args("/models/m", "lru")
    assert lru == {"model_path": "/models/m", "radix_eviction_policy": "lru"}
    hicache = build_server_args("/models/m", "hicache", max_total_tokens=4096, hicache_ratio=3.0, random_seed=1)
    assert hicache["enable_hierarchical_cache"] is True and hicache["radix_eviction_policy"] == "lru"
    assert hicache["hicache_ratio"] == 3.0 and hicache["max_total_tokens"] == 4096 and hicache["random_seed"] == 1
    assert hicache["hicache_write_policy"] == "write_back"
    kvflow = build_server_args("/models/m", "kvflow", skip_tokenizer_init=True, load_format="dummy",
                               extra={"hicache_write_policy": "write_through", "page_size": 16})
    assert kvflow["radix_eviction_policy"] == "kvflow" and kvflow["enable_hierarchical_cache"] is True
    assert kvflow["skip_tokenizer_init"] is True and kvflow["load_format"] == "dummy"
    assert kvflow["hicache_write_policy"] == "write_through" and kvflow["page_size"] == 16
    assert "skip_tokenizer_init" not in lru  # only when asked: SGLang tokenizes otherwise
    # the plugin builds the combination's core policies from its config; options merge in
    assert kvflow["radix_eviction_policy_config"] == {"eviction": "kvflow", "prefetch": "steps-ahead",
                                                      "admission": "lpm-status-aware"}
    tuned = build_server_args("/models/m", "kvflow-noprefetch", extra={"radix_eviction_policy_config": {"horizon": 2}})
    assert tuned["radix_eviction_policy"] == "kvflow" and tuned["enable_hierarchical_cache"] is True
    assert tuned["radix_eviction_policy_config"] == {"eviction": "kvflow", "prefetch": "none",
                                                     "admission": "lpm-status-aware", "horizon": 2}
    # SGLang's own longest-prefix-match order runs stock SGLang; PEEK's runs through the plugin
    lpm = build_server_args("/models/m", "lpm")
    assert lpm["radix_eviction_policy"] == "lru" and lpm["schedule_policy"] == "lpm"
    assert "radix_eviction_policy_config" not in lpm and lpm["enable_hierarchical_cache"] is True
    qa = build_server_args("/models/m", "queue-aware")
    assert qa["radix_eviction_policy"] == "kvflow" and "schedule_policy" not in qa
    assert qa["radix_eviction_policy_config"] == {"eviction": "demand-lru", "prefetch": "none",
                                                  "admission": "queue-aware"}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"policy": "belady"}, "cannot run on SGLang"),
    ({"extra": {"radix_eviction_policy_config": {"horizn": 2}}}, "unknown key.*horizn.*accepted: eviction"),
    ({"extra": {"radix_eviction_policy_config": {"eviction": "lru"}}}, "set by the adapter from policy"),
    ({"policy": "lru", "extra": {"radix_eviction_policy_config": {"horizon": 2}}}, "SGLang's own eviction"),
    ({"model_path": ""}, "model_path is required"),
    ({"extra": {"radix_eviction_policy": "lfu"}}, "set by the adapter"),
    ({"extra": {"model_path": "/other"}}, "set by the adapter"),
    ({"max_total_tokens": 10, "extra": {"max_total_tokens": 20}}, "given twice"),
    ({"policy": "lru", "hicache_ratio": 3.0}, "has none"),
    ({"hicache_ratio": 1.0}, "must be > 1"),
    ({"max_total_tokens": 0}, "must be positive"),
])
def test_bad_server_args_are_named(kwargs: dict[str, Any], message: str) -> None:
    args = {"model_path": "/models/m", "policy": "kvflow", **kwargs}
    with pytest.raises(ValueError, match=message):
        build_server_args(args.pop("model_path"), args.pop("policy"), **args)


def test_kvflow_needs_the_plugin_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_PLUGINS", "someone-else")  # SGLang would skip the kvflow plugin
    assert not plugin_registered()
    with pytest.raises(ValueError, match=r"pip install -e '\.\[sglang\]'"):
        SglangEngine("/models/m", policy="kvflow")


def test_without_sglang_the_engine_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` fails, installed or not
    monkeypatch.setenv(protocol.STATUS_DIR_ENV, "restored-after-the-test")
    monkeypatch.setenv(protocol.TREE_CORE_ENV, "python")
    with pytest.raises(ImportError, match=r"pip install 'kvflow-ray\[sglang\]'"):
        SglangEngine("/models/m", policy="lru", status_dir=tmp_path / "status")
    import os

    assert os.environ[protocol.STATUS_DIR_ENV] == str(tmp_path / "status")  # set before SGLang would spawn
    assert (tmp_path / "status").is_dir()  # a given status dir is the caller's: kept


# ---------------------------------------------------------------------------------------------- app config
@pytest.fixture
def sglang_importable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package named sglang on sys.path, so the config's import check passes (it never imports it)."""
    package = tmp_path / "site" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


def test_engine_sglang_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="needs model_path"):
        AppConfig(engine="sglang")
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "sglang", None)  # not importable, installed or not
        with pytest.raises(ValueError, match=r"pip install 'kvflow-ray\[sglang\]'"):
            AppConfig(engine="sglang", model_path="/models/m")
    with pytest.raises(ValueError, match="cannot run on SGLang"):
        AppConfig(engine="sglang", model_path="/models/m", policy="belady")
    with pytest.raises(ValueError, match="has none"):
        AppConfig(engine="sglang", model_path="/models/m", policy="lru", sglang_args={"hicache_ratio": 4})
    with pytest.raises(ValueError, match="set by the adapter"):
        AppConfig(engine="sglang", model_path="/models/m", sglang_args={"radix_eviction_policy": "lfu"})
    with pytest.raises(ValueError, match="engine 'sglang' only"):
        AppConfig(engine="cpu", sglang_args={"mem_fraction_static": 0.8})
    with pytest.raises(ValueError, match="replica_num_gpus"):
        AppConfig(replica_num_gpus=-1)


@pytest.mark.usefixtures("sglang_importable")
def test_engine_sglang_config() -> None:
    config = AppConfig(engine="sglang", model_path="/models/m", device_kv_tokens=4096, seed=3,
                       sglang_args={"mem_fraction_static": 0.8})
    assert config.replica_num_gpus == 1.0  # one GPU per replica unless told otherwise
    assert AppConfig(engine="sglang", model_path="/models/m", replica_num_gpus=0.5).replica_num_gpus == 0.5
    assert AppConfig().replica_num_gpus == 0.0 and AppConfig(engine="sim").replica_num_gpus == 0.0
    assert config.model_name() == "/models/m"
    assert config.tokenizer_path() == "/models/m"
    dummy = AppConfig(engine="sglang", model_path="/m", sglang_args={"skip_tokenizer_init": True})
    assert dummy.tokenizer_path() is None  # token ids only: byte-level text, like the ingress without one
    kwargs = config.sglang_engine_kwargs()
    assert kwargs == {"model_path": "/models/m", "policy": "kvflow", "max_total_tokens": 4096, "random_seed": 3,
                      "server_args": {"mem_fraction_static": 0.8}}
    args = build_server_args(kwargs.pop("model_path"), kwargs.pop("policy"), extra=kwargs.pop("server_args"),
                             **kwargs)
    assert args["max_total_tokens"] == 4096 and args["mem_fraction_static"] == 0.8
    assert AppConfig.from_dict(config.to_dict()) == config


@pytest.mark.usefixtures("sglang_importable")
def test_the_sglang_deploy_file_is_a_valid_app() -> None:
    serve_file = yaml.safe_load((ROOT / "deploy" / "serve-sglang.yaml").read_text())
    app = serve_file["applications"][0]
    assert app["import_path"] == "kvflow_ray.serve.app:build_app"
    config = AppConfig.from_dict(app["args"])
    assert config.engine == "sglang" and config.replica_num_gpus == 1 and config.policy == "kvflow"
    cpu_file = yaml.safe_load((ROOT / "deploy" / "serve-cpu.yaml").read_text())
    assert set(serve_file) == set(cpu_file)  # the same structure as the CPU deployment


# ---------------------------------------------------------------------------------------------- smoke script
def test_the_dummy_model_config_is_llama_3_1_8b(tmp_path: Path) -> None:
    model_dir = smoke.write_model_config(tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == \
           (4096, 32, 32, 8, 14336, 128256)
    assert config["rope_theta"] == 500000.0 and config["max_position_embeddings"] == 131072
    assert config["torch_dtype"] == "bfloat16"
    assert json.loads((model_dir / "generation_config.json").read_text())["bos_token_id"] == 128000
    # KV per token as docs/design.md's a10g-llama3.1-8b profile has it: 128 KiB
    assert smoke.KV_BYTES_PER_TOKEN == 128 * 1024
    transformers = pytest.importorskip("transformers")  # what SGLang reads the config with
    hf = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    assert hf.model_type == "llama" and hf.num_key_value_heads == 8 and hf.head_dim == 128


def test_smoke_sizing_puts_the_device_pool_under_pressure() -> None:
    agents, fixed, dynamic, output = 10, 8192, 32, 32
    device = smoke.default_device_tokens(agents, fixed, dynamic, output)
    per_request = fixed + dynamic + output
    assert 2 * per_request <= device < agents * per_request and device % 64 == 0
    ratio = smoke.default_hicache_ratio(agents, fixed, dynamic, output, device)
    assert ratio >= 2 and ratio * device >= agents * per_request  # the host tier holds every agent
    assert smoke.profile_name("NVIDIA H200") == "h200-llama3.1-8b-dummy"
    assert smoke.profile_name("NVIDIA A10G") == "a10g-llama3.1-8b-dummy"
    assert smoke.profile_name("") == "gpu-llama3.1-8b-dummy"
    prompts = smoke.make_prompts(["a", "b"], 50, seed=1)
    assert prompts == smoke.make_prompts(["a", "b"], 50, seed=1) and prompts["a"] != prompts["b"]
    assert all(smoke.TOKEN_LOW <= t < smoke.TOKEN_HIGH for p in prompts.values() for t in p)
    spec = smoke.workflow_spec(smoke.DEFAULT_WORKFLOW, None)
    assert spec.name == "microbench10" and len(spec.agents) == 10
    assert len(smoke.workflow_spec(smoke.DEFAULT_WORKFLOW, 4).agents) == 4


def _record(agent: str, iteration: int, measured: bool, gpu: int, cpu: int, miss: int) -> Any:
    return smoke.RequestRecord(agent, iteration, measured, gpu + cpu + miss, gpu, cpu, miss, 0.0, 0.05, 0.2)


def test_smoke_result_shape_from_request_records() -> None:
    records = [_record("a", 0, False, 0, 0, 100), _record("b", 0, False, 0, 0, 100),  # warm-up: left out
               _record("a", 1, True, 60, 30, 10), _record("b", 1, True, 0, 90, 10),
               _record("a", 2, True, 90, 0, 10), _record("b", 2, True, 90, 0, 10)]
    iterations = [IterationRecord("smoke/0", 0, 0.0, 1.0, False), IterationRecord("smoke/0", 1, 1.0, 1.5, True),
                  IterationRecord("smoke/0", 2, 1.5, 2.5, True)]
    # no plugin status (SglangEngine reports which keys the plugin wrote): loads from the requests
    no_status = {**empty_snapshot(), "status_keys": []}
    result = smoke.summarise_policy(records, iterations, 2.5, 4096, no_status, no_status)
    assert set(result) >= RESULT_KEYS
    assert result["latency_s"] == pytest.approx(0.75) and result["p99_latency_s"] == pytest.approx(1.0)
    assert result["gpu_hit_ratio"] == pytest.approx(240 / 400) and result["cpu_hit_ratio"] == pytest.approx(120 / 400)
    assert result["recomputed_tokens"] == 40 and result["loaded_tokens"] == 120
    assert result["prefetch_stall_s"] == 0.0 and result["requests_measured"] == 4
    assert result["sources"] == {"loaded_tokens": "requests", "prefetch_stall_s": "requests"}
    assert result["pass_latencies_s"] == pytest.approx([0.5, 1.0])
    # the plugin reports loads and stalls: the measured window's difference
    before = merge_stats({"loaded_tokens": 100, "prefetch_stall_s": 0.5, "prefetch": {"issued": 2}}, {})
    after = merge_stats({"loaded_tokens": 400, "prefetch_stall_s": 0.9, "prefetch": {"issued": 6, "used": 3}}, {})
    after["status_keys"] = ["loaded_tokens", "prefetch", "prefetch_stall_s"]
    with_status = smoke.summarise_policy(records, iterations, 2.5, 4096, before, after)
    assert with_status["loaded_tokens"] == 300 and with_status["prefetch_stall_s"] == pytest.approx(0.2)
    assert with_status["prefetch_issued"] == 4 and with_status["prefetch_used"] == 3

    slower = {**result, "latency_s": 1.5}
    out = smoke.report("h200-llama3.1-8b-dummy", {"workflow": "microbench10", "agents": 2}, {},
                       {"lru": slower, "hicache": slower, "kvflow": result})
    assert out["scenario"] == "single" and out["profile"] == "h200-llama3.1-8b-dummy"
    assert set(out["results"]) == {"lru", "hicache", "kvflow"}
    assert out["speedup"]["vs_lru"]["kvflow"] == pytest.approx(2.0)
    assert out["speedup"]["vs_hicache"]["lru"] == pytest.approx(1.0)
    json.dumps(out)  # one JSON object


def test_smoke_driver_runs_the_workflow_with_hints() -> None:
    """The driver over a real engine that runs here (the simulator's serving engine, simulated A10G at 100x)."""
    from kvflow_ray.engines.sim.serving import SimEngine

    spec = smoke.workflow_spec(smoke.DEFAULT_WORKFLOW, 4)
    plan = smoke.build_plan(spec, fixed=256, dynamic=8, output=4, iterations=3, warmup=1, seed=0, low=0, high=256)
    results = {}
    for policy in ("lru", "kvflow"):
        engine = SimEngine("a10g-llama3.1-8b", policy=policy, time_scale=0.01, device_kv_tokens=700)
        try:
            progress: list[str] = []
            driver = smoke.SmokeDriver(engine, plan, low=0, high=256, progress=progress.append)
            makespan = driver.run(request_timeout_s=60)
            after = engine.stats()
            results[policy] = smoke.summarise_policy(driver.records, driver.iterations, makespan, 700,
                                                     driver.stats_at_measure, after)
        finally:
            engine.close()
        assert len(driver.records) == 4 * 4 and sum(r.measured for r in driver.records) == 12
        assert [r.agent for r in driver.records[:4]] == list(spec.agents)  # in the loop's order
        assert len(progress) == 4 and "warm-up" in progress[0]
        assert driver.stats_at_measure is not None
        assert set(results[policy]) >= RESULT_KEYS and results[policy]["workflows_measured"] == 3
    # kvflow learned the steps-to-execution and prefetched the next agent; LRU evicted it every time
    assert results["kvflow"]["gpu_hit_ratio"] > results["lru"]["gpu_hit_ratio"]
    assert results["kvflow"]["prefetch_issued"] > 0
    assert not math.isnan(results["kvflow"]["latency_s"])


def test_smoke_script_help_and_flag_errors_without_sglang() -> None:
    help_run = subprocess.run([sys.executable, str(SMOKE), "--help"], capture_output=True, text=True, timeout=120)
    assert help_run.returncode == 0, help_run.stderr
    for flag in ("--policies", "--fixed", "--dynamic", "--output", "--iterations", "--device-kv-tokens", "--out"):
        assert flag in help_run.stdout
    bad = subprocess.run([sys.executable, str(SMOKE), "--policies", "belady"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--policies" in bad.stderr
    args = smoke.parse_args(["--server-arg", "page_size=16", "--server-arg", "attention_backend=fa3"])
    assert args.server_arg == {"page_size": 16, "attention_backend": "fa3"} and args.policies == list(smoke.POLICIES)


# ---------------------------------------------------------------------------------------------- the adapter
class StandInEngine:
    """Stands in for `sglang.Engine`, which needs CUDA: the surface the adapter uses, with SGLang's
    behaviour where the adapter depends on it (async_generate streams the whole output so far in one
    growing list; meta_info reports cached tokens by tier; aborts; collective_rpc; a plugin-like status
    writer). A prompt's longest prefix seen before under the same `cache_salt` counts as a device hit
    (SGLang keys its tree by the salt)."""

    instances: ClassVar[list[StandInEngine]] = []

    def __init__(self, **kwargs: Any) -> None:
        import os
        import types

        self.kwargs = kwargs
        self.status_dir = Path(os.environ[protocol.STATUS_DIR_ENV])  # what the scheduler would inherit
        self.rpcs: list[tuple[str, dict[str, Any]]] = []
        self.seen: list[tuple[str | None, list[int]]] = []
        self.shut = False
        self.server_args = types.SimpleNamespace(incremental_streaming_output=False)
        self.tokenizer_manager = types.SimpleNamespace(
            tokenizer=None, context_len=4096, model_config=types.SimpleNamespace(vocab_size=1000))
        self._scheduler_init_result = types.SimpleNamespace(scheduler_infos=[{"max_total_num_tokens": 2048}])
        StandInEngine.instances.append(self)

    async def async_generate(self, *, input_ids: list[int], sampling_params: dict[str, Any], stream: bool,
                             rid: str, cache_salt: str | None = None) -> Any:
        import asyncio

        assert stream and rid.startswith("kvflow-")
        assert cache_salt is None or (isinstance(cache_salt, str) and cache_salt)  # SGLang: "" means none
        hit = max((_common(input_ids, s) for salt, s in self.seen if salt == cache_salt), default=0)
        self.seen.append((cache_salt, list(input_ids)))
        kv = sampling_params.get("custom_params", {}).get("kvflow")
        if kv is not None:  # the plugin's status: a stored event for the fixed prompt, its counters
            with (self.status_dir / "events.jsonl").open("a") as f:
                f.write(json.dumps({"kind": "stored", "tier": "gpu", "prefix_hash": kv["agent"],
                                    "tokens": kv.get("fixed_prefix_tokens", 0)}) + "\n")
            (self.status_dir / "stats.json").write_text(json.dumps({"waiting": 0, "running": 1,
                                                                     "loaded_tokens": 7}))

        async def chunks() -> Any:
            if 999 in input_ids:
                yield {"output_ids": [], "meta_info": {"finish_reason": {
                    "type": "abort", "message": "refused by the stand-in", "status_code": 400}}}
                return
            out: list[int] = []
            n = sampling_params["max_new_tokens"]
            for i in range(n):
                await asyncio.sleep(0.001)
                out.append((input_ids[-1] + i) % 256)
                # SGLang ends at a stop string and still sends its tokens (it trims only its text)
                text = bytes(out).decode("utf-8", errors="replace")
                matched = next((s for s in sampling_params.get("stop", []) if s in text), None)
                last = i == n - 1 or matched is not None
                reason = {"type": "stop", "matched": matched} if matched else {"type": "length", "length": n}
                meta = {"prompt_tokens": len(input_ids), "cached_tokens": hit,
                        "finish_reason": reason if last else None}
                if hit:
                    meta["cached_tokens_details"] = {"device": hit, "host": 0}
                yield {"output_ids": out, "meta_info": meta}  # the same list, growing (SGLang's default)
                if last:
                    return

        return chunks()

    def collective_rpc(self, method: str, **kwargs: Any) -> None:
        self.rpcs.append((method, kwargs))

    def shutdown(self) -> None:
        self.shut = True


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture
def stand_in_sglang(monkeypatch: pytest.MonkeyPatch) -> type[StandInEngine]:
    import types

    module = types.ModuleType("sglang")
    module.Engine = StandInEngine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.setenv(protocol.STATUS_DIR_ENV, "restored-after-the-test")
    monkeypatch.setenv(protocol.TREE_CORE_ENV, "python")
    StandInEngine.instances.clear()
    return StandInEngine


def test_the_adapter_serves_requests_hints_events_and_stats(stand_in_sglang: type[StandInEngine],
                                                          tmp_path: Path) -> None:
    import threading

    status = tmp_path / "status"
    engine = SglangEngine("/models/m", policy="hicache", status_dir=status, send_hints=True, max_total_tokens=2048,
                          server_args={"page_size": 1})
    sg = stand_in_sglang.instances[0]
    assert sg.status_dir == status  # the status dir was in the environment when SGLang started
    assert sg.kwargs == {"model_path": "/models/m", "radix_eviction_policy": "lru", "enable_hierarchical_cache": True,
                         "hicache_ratio": 2.0, "hicache_write_policy": "write_back", "max_total_tokens": 2048,
                         "page_size": 1}
    assert (engine.vocab_size, engine.max_context, engine.device_tokens) == (1000, 4096, 2048)
    prompt = list(range(10, 60))
    first = engine.generate(GenerateRequest(tokens=[*prompt, 1, 2], max_tokens=4, workflow="w1", agent="planner",
                                            fixed_prefix_tokens=50))
    assert first.tokens == [2, 3, 4, 5] and first.finish_reason == "length"
    assert (first.prompt_tokens, first.gpu_hit_tokens, first.miss_tokens) == (52, 0, 52)
    assert 0 < first.ttft_s <= first.latency_s
    # streamed: the tokens as they come, then the result; the prefix is a device hit now
    items = list(engine.stream(GenerateRequest(tokens=[*prompt, 7], max_tokens=3)))
    result = items[-1]
    assert items[:-1] == result.tokens == [7, 8, 9]
    assert (result.gpu_hit_tokens, result.cpu_hit_tokens, result.miss_tokens) == (50, 0, 1)
    # concurrent callers share the one loop
    results: list[Any] = []
    threads = [threading.Thread(target=lambda i=i: results.append(
        engine.generate(GenerateRequest(tokens=[100 + i] * 8, max_tokens=2)))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 8
    # refused before SGLang sees it, or by SGLang
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.submit(GenerateRequest(tokens=[5000]))
    with pytest.raises(ValueError, match="device KV pool"):
        engine.submit(GenerateRequest(tokens=[1] * 2048, max_tokens=8))
    with pytest.raises(ValueError, match="refused by the stand-in"):
        engine.generate(GenerateRequest(tokens=[1, 999]))
    # hints reach the scheduler through collective_rpc, in the protocol's encoding
    engine.apply_hints(Hints(steps={"w1": {"planner": 0, "writer": math.inf}}, prompts={("w1", "planner"): prompt},
                             retire=["w0"]))
    engine.apply_hints(Hints())  # nothing to say: no round trip
    assert [m for m, _ in sg.rpcs] == [protocol.RPC_APPLY_HINTS]
    steps, prompts, retire, salts, _elsewhere = protocol.decode_hints(sg.rpcs[0][1]["payload"])
    assert steps == {"w1": {"planner": 0, "writer": math.inf}} and prompts == {("w1", "planner"): tuple(prompt)}
    assert retire == ["w0"] and salts == {}
    # the plugin's events, drained
    assert engine.cache_events() == [CacheEvent("stored", "gpu", "planner", 50)]
    assert engine.cache_events() == []
    stats = engine.stats()
    assert stats["requests_done"] == 10 and stats["requests_failed"] == 1 and stats["requests_rejected"] == 2
    assert stats["prompt_tokens"] == {"gpu": 50, "cpu": 0, "miss": 52 + 1 + 64}  # the adapter's own counts
    assert stats["loaded_tokens"] == 7 and stats["status_keys"] == ["loaded_tokens", "running", "waiting"]
    assert stats["status_age_s"] is not None and stats["capacity_tokens"]["gpu"] == 2048
    ReplicaMetrics("r0").observe_stats(stats)
    engine.close()
    assert sg.shut and status.is_dir()  # a given status dir is the caller's
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(GenerateRequest(tokens=[1]))


def test_the_adapter_owns_a_default_status_dir_and_skips_hints_for_stock_policies(
        stand_in_sglang: type[StandInEngine]) -> None:
    with SglangEngine("/models/m", policy="lru", skip_tokenizer_init=True) as engine:
        assert stand_in_sglang.instances[0].kwargs["skip_tokenizer_init"] is True
        assert engine.status_dir.is_dir() and engine.tokenizer.decode([104, 105]) == "hi"  # byte-level text
        engine.apply_hints(Hints(steps={"w": {"a": 1}}))  # lru is SGLang's own: the plugin is not asked
        assert stand_in_sglang.instances[0].rpcs == []
        assert engine.generate(GenerateRequest(prompt="hello", max_tokens=1)).prompt_tokens == 5
        assert engine.stats()["status_age_s"] is None and engine.stats()["running"] == 0
    assert not engine.status_dir.exists()


def test_the_adapter_sends_each_requests_cache_salt(stand_in_sglang: type[StandInEngine], tmp_path: Path) -> None:
    """The salt reaches SGLang with the request (the stand-in, like SGLang, reuses KV only under the same
    salt), and hints that only name salts still go to the plugin."""
    with SglangEngine("/models/m", policy="kvflow", status_dir=tmp_path / "status", send_hints=True,
                      max_total_tokens=2048) as engine:
        sg = stand_in_sglang.instances[0]
        prompt = list(range(10, 60))

        def run(salt: str) -> Any:
            return engine.generate(GenerateRequest(tokens=prompt, max_tokens=2, cache_salt=salt))

        first_a, b, plain, second_a = run("a"), run("b"), run(""), run("a")
        assert [salt for salt, _tokens in sg.seen] == ["a", "b", None, "a"]
        assert first_a.gpu_hit_tokens == b.gpu_hit_tokens == plain.gpu_hit_tokens == 0
        assert second_a.gpu_hit_tokens == len(prompt)
        engine.apply_hints(Hints(salts={"c1": "a"}))
        assert protocol.decode_hints(sg.rpcs[-1][1]["payload"])[3] == {"c1": "a"}


def test_the_adapter_cuts_the_output_before_a_stop_string(stand_in_sglang: type[StandInEngine]) -> None:
    """SGLang ends the request at the stop string but sends its tokens; the result excludes them, and a
    streaming client never gets them (held back while they may start the stop string)."""
    with SglangEngine("/models/m", policy="lru", skip_tokenizer_init=True) as engine:
        prompt = list(b"say: a")  # the stand-in answers with the next bytes: "abcdefgh..."
        full = engine.generate(GenerateRequest(tokens=prompt, max_tokens=8))
        assert full.text == "abcdefgh" and full.finish_reason == "length"
        request = GenerateRequest(tokens=prompt, max_tokens=8, stop=["ef", "cx"])  # "c" is held, then "d" frees it
        result = engine.generate(request)
        assert result.text == "abcd" and result.tokens == list(b"abcd") and result.finish_reason == "stop"
        *streamed, last = list(engine.stream(request))
        assert streamed == result.tokens and last.text == "abcd"  # type: ignore[union-attr]
        unmet = engine.generate(GenerateRequest(tokens=prompt, max_tokens=8, stop=["zz"]))
        assert unmet.text == full.text and unmet.tokens == full.tokens and unmet.finish_reason == "length"
