"""The serving layer's pure parts, without Ray: app config (and that deploy/serve-cpu.yaml deploys what
`kvflow-ray serve` deploys), the CLI's argument errors, merged metrics, the chat-prefix tokens an
engine keeps for an agent, and the load generator's walk of each example workflow."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvflow_ray.cli import main
from kvflow_ray.client import Workflow
from kvflow_ray.client.loadgen import _calls_per_iteration, application_variants
from kvflow_ray.commands import serve as serve_command
from kvflow_ray.engines.base import GenerateResult
from kvflow_ray.engines.tokenizer import ByteTokenizer
from kvflow_ray.serve.config import AppConfig
from kvflow_ray.serve.metrics import ReplicaMetrics, RouterMetrics, merge_expositions
from kvflow_ray.serve.openai_api import agent_prefix, fixed_boundary

ROOT = Path(__file__).resolve().parents[1]


def _serve_config(*argv: str) -> AppConfig:
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    return serve_command.app_config(parser.parse_args(list(argv)))


def test_app_config_rejects_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="unknown app config keys \\['replica'\\]"):
        AppConfig.from_dict({"replica": 3})
    with pytest.raises(ValueError, match="unknown profile 'h200'"):
        AppConfig(engine="sim", profile="h200")
    with pytest.raises(ValueError, match="time_scale"):
        AppConfig(engine="sim", time_scale=0)
    assert AppConfig(engine="sim").model_name() == "sim-a10g-llama3.1-8b"
    with pytest.raises(ValueError, match="SGLang plugin"):
        AppConfig(engine="sglang")
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        AppConfig(routing="random")
    with pytest.raises(ValueError, match="replicas"):
        AppConfig(replicas=0)
    with pytest.raises(ValueError, match="api_keys"):
        AppConfig(api_keys={"": "acme"})
    with pytest.raises(ValueError, match=r"template_idle_ttl_s .* must be at least state_ttl_s"):
        AppConfig(state_ttl_s=600, template_idle_ttl_s=60)
    with pytest.raises(ValueError, match="ingress_sync_s"):
        AppConfig(ingress_sync_s=0)  # an ingress syncing without pause would spin the router actor
    with pytest.raises(ValueError, match=r"tenant_kv_budget\.acme: kv_budget must be"):
        AppConfig(tenant_kv_budget={"acme": 8})
    assert AppConfig(tenant_kv_budget={"acme": 1024}).tenant_kv_budget == {"acme": 1024}
    settings = AppConfig(state_ttl_s=600, store_grace_s=5, ingress_sync_s=0.1).router_settings()  # the actor's
    assert settings.state_ttl_s == 600 and settings.store_grace_s == 5 and settings.template_ttl_s >= 600
    assert settings.sync_s == 0.1  # and each ingress's
    # the engines' policy says how the router ranks agents
    assert settings.prediction == "graph"
    assert AppConfig(policy="predictive").router_settings().prediction == "learned"


def test_api_keys_can_come_from_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """In Kubernetes the keys come from a Secret mounted as env, not from the config file."""
    monkeypatch.setenv("KVFLOW_TEST_KEYS", '{"k2": "beta"}')
    config = AppConfig(api_keys={"k1": "acme"}, api_keys_env="KVFLOW_TEST_KEYS")
    assert config.tenant_for("k1") == "acme" and config.tenant_for("k2") == "beta"
    assert config.tenant_for("nope") is None
    assert config.to_dict()["api_keys"] == {"k1": "acme"}, "env keys never travel in Ray's deployment args"
    monkeypatch.setenv("KVFLOW_TEST_KEYS", "[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        AppConfig(api_keys_env="KVFLOW_TEST_KEYS")
    monkeypatch.setenv("KVFLOW_TEST_KEYS", "{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        AppConfig(api_keys_env="KVFLOW_TEST_KEYS")
    monkeypatch.delenv("KVFLOW_TEST_KEYS")
    with pytest.raises(ValueError, match="KVFLOW_TEST_KEYS is not set"):
        AppConfig(api_keys_env="KVFLOW_TEST_KEYS")


def test_tenants_come_from_api_keys() -> None:
    assert AppConfig().tenant_for(None) == "default"  # no keys configured: one open tenant
    keyed = AppConfig(api_keys={"k1": "acme"})
    assert keyed.tenant_for("k1") == "acme"
    assert keyed.tenant_for("k2") is None and keyed.tenant_for(None) is None


def test_the_deploy_file_deploys_what_kvflow_ray_serve_deploys() -> None:
    serve_file = yaml.safe_load((ROOT / "deploy" / "serve-cpu.yaml").read_text())
    app = serve_file["applications"][0]
    assert app["import_path"] == "kvflow_ray.serve.app:build_app"
    assert AppConfig.from_dict(app["args"]) == _serve_config()
    from_file = _serve_config("--config", str(ROOT / "deploy" / "serve-cpu.yaml"), "--replicas", "3")
    assert from_file.replicas == 3 and from_file.policy == "kvflow"  # flags override the file


def test_cli_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--api-key", "no-tenant"]) == 2
    assert "KEY=TENANT" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nagents: {a: {after: [ghost]}}\n")
    assert main(["run", str(bad)]) == 2
    assert "ghost" in capsys.readouterr().err
    assert main(["run", str(ROOT / "workflows" / "peer.yaml"), "--clients", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err


def test_merged_metrics_keep_one_header_per_family_and_every_replica() -> None:
    a, b, router = ReplicaMetrics("a"), ReplicaMetrics("b"), RouterMetrics()
    result = GenerateResult([1], "x", 10, 6, 2, 2, 0.01, 0.02, 0.03, "length")
    a.observe_result(result)
    b.observe_result(result)
    router.observe_decision("affinity", 0.0001, "acme", deviation=False)
    text = merge_expositions([router.exposition(), a.exposition(), b.exposition()]).decode()
    assert text.count("# TYPE kvflow_prompt_tokens_total counter") == 1
    assert "_created" not in text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("kvflow_prompt_tokens_total", (("replica", "a"), ("tier", "gpu")))] == 6
    assert samples[("kvflow_prompt_tokens_total", (("replica", "b"), ("tier", "cpu")))] == 2
    assert samples[("kvflow_router_decisions_total", (("outcome", "affinity"),))] == 1


def test_agent_prefix_is_where_a_chat_request_of_the_agent_crosses_its_boundary() -> None:
    tok = ByteTokenizer()
    prompt = "You are the Planner. Plan in numbered steps."
    prefix = agent_prefix(tok.apply_chat_template, tok.encode, prompt)
    messages = [{"role": "system", "content": prompt}, {"role": "user", "content": "What changed?"}]
    full = tok.encode(tok.apply_chat_template(messages))
    assert fixed_boundary(tok.apply_chat_template, tok.encode, messages, prompt) == len(prefix)
    assert full[:len(prefix)] == prefix and tok.decode(prefix).endswith(prompt)


@pytest.mark.parametrize(("name", "calls"), [("peer", 4), ("software_team", 4), ("triage_branch", None),
                                             ("microbench10", 10)])
def test_the_load_generator_walks_each_example_workflow(name: str, calls: int | None) -> None:
    workflow = Workflow.from_yaml(ROOT / "workflows" / f"{name}.yaml")
    n = _calls_per_iteration(workflow)
    assert n == (calls if calls is not None else n) and 1 <= n <= len(workflow.spec.agents)
    apps = application_variants(workflow, 3, preamble_chars=200)
    assert len({a.name for a in apps}) == 3
    prompts = [a.spec.agents[workflow.spec.entry or sorted(workflow.spec.start_agents())[0]].prompt for a in apps]
    assert len(set(prompts)) == 3 and all(p and len(p) > 200 for p in prompts)
    assert all(a.spec.agents.keys() == workflow.spec.agents.keys() for a in apps)


def test_router_errors_map_to_http_statuses() -> None:
    from kvflow_ray.core.graph import SpecError, UnknownAgentError
    from kvflow_ray.router.core import NoReplicaError, UnknownClientError, UnknownWorkflowError
    from kvflow_ray.router.store import StoreUnavailableError
    from kvflow_ray.serve.ingress import _to_api_error

    cases = [(NoReplicaError("no live engine replica"), 503), (UnknownClientError("unknown client 'c'"), 404),
             (StoreUnavailableError("the state store has been unreachable"), 503),
             (UnknownWorkflowError("unknown workflow 'w'"), 404), (SpecError("agents", "is empty"), 400),
             (UnknownAgentError("ghost", "peer", ["planner"]), 400), (ValueError("bad"), 400)]
    for exc, status in cases:
        error = _to_api_error(exc)
        assert error is not None and error.status == status and str(exc) in error.message
    assert _to_api_error(RuntimeError("a bug")) is None  # not a request error: a 500, logged
    from ray.exceptions import ActorDiedError

    lost = _to_api_error(ActorDiedError())  # an engine replica died under the call, after its retry
    assert lost is not None and lost.status == 503 and lost.code == "replica_lost"
    assert lost.headers == {"Retry-After": "1"} and "actor" not in lost.message.lower()  # nothing of Ray's


def test_app_config_checks_tenants_and_sharing_groups_and_echoes_no_input() -> None:
    with pytest.raises(ValueError, match="tenant name 'a:b' is not valid"):
        AppConfig(api_keys={"k": "a:b"})
    with pytest.raises(ValueError, match="in two groups"):
        AppConfig(cache_sharing_groups={"g1": ["a"], "g2": ["a"]})
    with pytest.raises(ValueError, match="profile: Input should be a valid string"):
        AppConfig.from_dict({"profile": ["a", "b"]})
    with pytest.raises(ValueError, match=r"limits\.max_json_depth") as info:
        AppConfig.from_dict({"limits": {"max_json_depth": 1}})
    assert "input_value" not in str(info.value)
    with pytest.raises(ValueError) as info:
        AppConfig(engine="x" * 10_000)
    assert len(str(info.value)) < 200  # never echoed back unbounded
    config = AppConfig(api_keys={"k1": "a", "k2": "b", "k3": "c"}, cache_sharing_groups={"public": ["a", "b"]})
    assert config.cache_salt("a") == config.cache_salt("b") != config.cache_salt("c")
    assert AppConfig().cache_salt("default") == "tenant:default"


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 7}, "top_p", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "x"}], "extra": 1}, "extra", "unknown_parameter"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "kvflow": {"agent": "a"}}, "kvflow.client_id",
     "missing_required_parameter"),
    ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "missing_required_parameter"),
    ({}, "messages", "missing_required_parameter"),
])
def test_chat_requests_are_validated_strictly(body: dict, param: str, code: str) -> None:
    from kvflow_ray.serve.openai_api import ApiError, parse_request

    with pytest.raises(ApiError) as info:
        parse_request(body, chat=True)
    assert info.value.status == 400 and info.value.param == param and info.value.code == code


def test_valid_requests_keep_their_parameters() -> None:
    from kvflow_ray.serve.openai_api import parse_request

    chat = parse_request({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                          "stop": "END", "top_p": 0.5, "max_completion_tokens": 7, "seed": 3,
                          "custom_params": {"kvflow": {"client_id": "c", "agent": "a"}}}, chat=True)
    assert chat.stop == ["END"] and chat.top_p == 0.5 and chat.max_tokens == 7 and chat.seed == 3
    assert chat.meta is not None and chat.meta.client_id == "c"
    text = parse_request({"prompt": ["hello"], "stop": ["a", "b"]}, chat=False)
    assert text.prompt == "hello" and text.stop == ["a", "b"] and text.max_tokens == 16


def test_ray_wrapped_router_errors_lose_their_wrapper() -> None:
    """An exception raised in the router actor reaches the ingress as Ray's RayTaskError (pid, address,
    actor repr, traceback, colour codes); the client sees only the cause's message."""
    from ray.exceptions import RayTaskError

    from kvflow_ray.router.core import UnknownClientError
    from kvflow_ray.serve.ingress import _to_api_error, json_too_deep

    cause = UnknownClientError("unknown client 'c9'")
    wrapped = RayTaskError("WorkflowRouterActor.start_call", "Traceback (most recent call last):\n  pid=1 ip=2",
                           cause, proctitle="ray::WorkflowRouterActor").as_instanceof_cause()
    error = _to_api_error(wrapped)
    assert error is not None and error.status == 404 and error.message == "unknown client 'c9'"
    assert json_too_deep([[[[1]]]], 3) and not json_too_deep([[[1]]], 3)
    assert not json_too_deep({"a": [1, 2, {"b": "c"}]}, 3)


def test_a_replicas_load_report_is_its_engines_pool_usage_and_queue() -> None:
    from kvflow_ray.engines.base import GenerateRequest
    from kvflow_ray.engines.sim.serving import SimEngine
    from kvflow_ray.serve.replica import load_report

    engine = SimEngine(time_scale=0.01, device_kv_tokens=4096)
    try:
        assert load_report(engine.stats()) == {"capacity": 4096, "usage": 0.0, "waiting": 0}
        engine.generate(GenerateRequest(tokens=[i % 250 + 1 for i in range(1024)], max_tokens=4))
        load = load_report(engine.stats())
    finally:
        engine.close()
    assert load["capacity"] == 4096 and 1024 / 4096 <= load["usage"] <= 1.0 and load["waiting"] == 0


def test_serving_runs_the_simulators_routing_policies_by_the_same_names() -> None:
    """One name space: `routing` is what `kvflow-ray sim --routing` takes, options included; the
    default is the workflow router the simulator measures. Serve's request router is another key."""
    assert AppConfig().routing == "workflow" and AppConfig().request_router == "kvflow"
    assert AppConfig(routing="workflow:slack=0.5").router_settings().routing == "workflow:slack=0.5"
    with pytest.raises(ValueError, match="does not take nope"):
        AppConfig(routing="workflow:nope=1")
    with pytest.raises(ValueError, match="request_router must be one of"):
        AppConfig(request_router="random")
    # the keys of the earlier release name what replaced them
    with pytest.raises(ValueError, match="route_policy: renamed; use routing"):
        AppConfig.from_dict({"route_policy": "workflow"})
    with pytest.raises(ValueError, match="now request_router: serve"):
        AppConfig(routing="default")
    config = _serve_config("--routing", "dynamo-kv", "--request-router", "serve")
    assert (config.routing, config.request_router) == ("dynamo-kv", "serve")


def test_a_routing_policy_needing_what_serving_cannot_give_is_refused_at_start() -> None:
    """The SGLang plugin reports fixed prompts' blocks only: a policy reading every block is refused
    there (not run on a partial index); the workflow router and the history-tree ones run."""
    for routing in ("dynamo-kv", "llmd-precise"):
        with pytest.raises(ValueError, match=f"routing '{routing}' needs the KV block hashes .* sglang engine"):
            AppConfig(engine="sglang", model_path="m", routing=routing)
    for routing in ("workflow", "sglang-cache-aware", "ray-prefix", "pow2"):
        assert AppConfig(engine="sglang", model_path="m", routing=routing).routing == routing
    for engine in ("cpu", "sim"):  # they give every input
        assert AppConfig(engine=engine, routing="dynamo-kv").routing == "dynamo-kv"
