"""Serve workflows over an OpenAI-compatible API: local Ray, N engine replicas, the workflow router.

Starts (or joins, with RAY_ADDRESS) a Ray cluster, deploys the kvflow-ray app and serves until
Ctrl-C. The same app deploys from a Ray Serve config file: `serve run deploy/serve-cpu.yaml`.

Without --redis the router keeps its state in process (the embedded default): fine for one
machine, but a restarted router then forgets live workflows. With --redis it survives restarts.

Examples:
  kvflow-ray serve                                   # CPU engine, 2 replicas, http://127.0.0.1:8000
  kvflow-ray serve --replicas 4 --redis redis://127.0.0.1:6379/0
  kvflow-ray serve --config deploy/serve-cpu.yaml    # the app args of a Serve config file
  kvflow-ray serve --with-monitoring                 # + Prometheus with the alert rules, http://127.0.0.1:9090
  kvflow-ray serve --metrics-token T --with-monitoring  # /metrics only with `Authorization: Bearer T`
Then: kvflow-ray run workflows/peer.yaml --url http://127.0.0.1:8000

stdout: one JSON line once the app is healthy ({"url", "openai_base_url", "replicas"}); with
--with-monitoring a second line follows, "prometheus: http://127.0.0.1:PORT". Logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from kvflow_ray.core.safe_yaml import TextFileError, describe_yaml_error, load_yaml, read_text_file
from kvflow_ray.engines.cpu.weights import BUILTINS, DEFAULT_MODEL, RANDOM
from kvflow_ray.serve.config import ENGINES, REQUEST_ROUTERS, AppConfig


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default=None,
                        help="engine per replica: cpu (real compute, default), sim (GPU timing from a profile, "
                             "made-up tokens; for exercising the stack at GPU speed), sglang (SGLang 0.5.23 with "
                             "the kvflow plugin, one GPU per replica; needs --model-path; docs/sglang.md)")
    parser.add_argument("--model", default=None, metavar="NAME",
                        help=f"--engine cpu: the model, by name (default {DEFAULT_MODEL}: "
                             f"{BUILTINS[DEFAULT_MODEL].summary}; {RANDOM}: seeded random weights, a byte "
                             "tokenizer, for fast tests)")
    parser.add_argument("--model-path", default=None, metavar="DIR",
                        help="model directory (or hub id): required for --engine sglang; for cpu, a local Hugging "
                             "Face model directory instead of --model")
    parser.add_argument("--gguf", default=None, metavar="FILE",
                        help="--engine cpu: a GGUF model file instead of --model, dequantized once into the model "
                             "cache")
    parser.add_argument("--model-cache", default=None, metavar="DIR",
                        help="where dequantized models are kept (default $KVFLOW_MODEL_CACHE or "
                             "~/.cache/kvflow-ray/models)")
    parser.add_argument("--replicas", type=int, default=None, help="engine replicas (default 2)")
    parser.add_argument("--redis", default=None, help="redis://host:port/db for durable router state "
                        "(default: the embedded in-process store)")
    parser.add_argument("--routing", default=None, metavar="POLICY",
                        help="which replica serves each agent call: a routing policy, as `kvflow-ray sim "
                             "--routing` takes (default workflow, the workflow router; peers' routers: ray-prefix, "
                             "sglang-cache-aware, dynamo-kv, llmd-precise; pow2, round-robin, prefix-affinity)")
    parser.add_argument("--request-router", choices=REQUEST_ROUTERS, default=None,
                        help="kvflow: Serve sends each call where the routing policy chose (default); serve: "
                             "Ray Serve's own request router, blind to it (for comparison)")
    parser.add_argument("--policy", default=None, help="engine cache policy: lru, hicache, kvflow (default)")
    parser.add_argument("--device-kv-tokens", type=int, default=None,
                        help="device KV pool per replica in tokens (default: cpu 12288; sim: the profile's GPU)")
    parser.add_argument("--profile", default=None,
                        help="--engine sim: the GPU cost profile each replica simulates (default a10g-llama3.1-8b)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="--engine sim: wall seconds per simulated second (default 1; 0.1 = 10x faster)")
    parser.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help="how the model's output holds tool calls (default hermes: <tool_call>{json}</tool_call>, "
                             "the fallback rendering's format; sglang:<name>: SGLang's own parser of that name, e.g. "
                             "sglang:qwen25, sglang:llama3, sglang:mistral; docs/serving.md, Tool calls)")
    parser.add_argument("--session-retain-tokens", type=int, default=None, metavar="N",
                        help="agent sessions: per tenant and replica, at most N tokens of paused histories rank as "
                             "needed (docs/design.md §11; default unbounded: a pause never pins memory either way)")
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY=TENANT",
                        help="accept bearer KEY for TENANT (repeatable); none = one open 'default' tenant")
    parser.add_argument("--config", type=Path, default=None,
                        help="app args from a YAML/JSON file: either the args mapping itself or a Ray Serve "
                             "config file (its first application's args); flags override it")


def app_config(args: argparse.Namespace) -> AppConfig:
    data: dict[str, Any] = {}
    if args.config is not None:
        try:
            # no YAML anchors/aliases (an alias bomb would spin for minutes), at most 4 MiB
            raw = load_yaml(read_text_file(args.config))
        except (OSError, TextFileError, yaml.YAMLError) as exc:
            reason = (describe_yaml_error(exc) if isinstance(exc, yaml.YAMLError)
                      else exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)
            raise ValueError(f"cannot read --config {args.config}: {reason}") from None
        if isinstance(raw, dict) and "applications" in raw:
            apps = raw["applications"] or [{}]
            if not isinstance(apps, list) or not isinstance(apps[0], dict):
                raise ValueError(f"--config {args.config}: applications must be a list of mappings")
            raw = apps[0].get("args", {})
        if not isinstance(raw, dict):
            raise ValueError(f"--config {args.config}: expected a mapping of app args")
        data.update(raw)
    for key in ("engine", "replicas", "redis", "routing", "request_router", "policy", "model", "model_path", "gguf",
                "model_cache",
                "device_kv_tokens", "profile", "time_scale", "tool_call_parser", "session_retain_tokens"):
        value = getattr(args, key, None)
        if value is not None:
            data[key] = value
    if getattr(args, "api_key", None):
        keys = {}
        for item in args.api_key:
            key, sep, tenant = item.partition("=")
            if not sep or not key or not tenant:
                raise ValueError(f"--api-key {item!r}: expected KEY=TENANT")
            keys[key] = tenant
        data["api_keys"] = keys
    metrics_token = getattr(args, "metrics_token", None)
    if metrics_token is not None:
        if not metrics_token.strip():
            raise ValueError("--metrics-token: empty (omit the flag to leave /metrics open)")
        data["metrics_token"] = metrics_token
    try:
        config = AppConfig.from_dict(data)
    except TypeError as exc:  # a wrongly typed value that got past validation: still a config error, not a crash
        raise ValueError(f"invalid app config: {exc}") from None
    if config.engine == "cpu":
        # the model's files now, before Ray starts: a missing model is a one-line error, and a GGUF file is
        # dequantized here once rather than by every replica
        config.cpu_model_dir()
    return config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--with-monitoring", action="store_true",
                        help="also run Prometheus (the `prometheus` binary on PATH; Debian: apt-get install "
                             "prometheus) on 127.0.0.1, scraping this app with the rules and alerts of "
                             "deploy/prometheus/ (docs/serving.md, Monitoring); stopped with the server")
    parser.add_argument("--prometheus-port", type=int, default=9090,
                        help="--with-monitoring: Prometheus' HTTP port (default 9090)")
    parser.add_argument("--metrics-token", default=None, metavar="TOKEN",
                        help="answer GET /metrics (tenant names, traffic, cache behaviour) only with the header "
                             "`Authorization: Bearer TOKEN`, 401 otherwise. Prometheus sends it when its scrape "
                             "config has `authorization: {type: Bearer, credentials_file: <a file holding "
                             "TOKEN>}`; --with-monitoring sets that up itself. A flag is visible to other users "
                             "in `ps`: on shared machines put `metrics_token_env: VAR` in --config instead "
                             "(the environment variable VAR holds the token)")


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    try:
        config = app_config(args)
    except (ValueError, TypeError) as exc:
        print(f"kvflow-ray serve: error: {exc}", file=sys.stderr)
        return 2
    from kvflow_ray.serve.monitoring import LocalPrometheus, MonitoringError, scrape_target

    prometheus = None
    if getattr(args, "with_monitoring", False):
        prometheus = LocalPrometheus(scrape_target(args.host, args.port), port=args.prometheus_port,
                                     metrics_token=config.metrics_token_value())
        try:
            prometheus.check()  # before the minute Ray takes to start
        except MonitoringError as exc:
            print(f"kvflow-ray serve: --with-monitoring: {exc}", file=sys.stderr)
            return 2
    from kvflow_ray.serve.app import LocalServer, say_on_stderr, stdout_to_stderr

    server = LocalServer(config, host=args.host, port=args.port)
    print(f"starting {config.replicas} {config.engine} replica(s), routing={config.routing}, "
          f"store={'redis' if config.redis else 'embedded'} ...", file=sys.stderr)
    status = 0
    try:
        with stdout_to_stderr():  # stdout: the JSON line below (and Prometheus' URL), for scripts
            server.start(say=say_on_stderr)
        # after Ray's start, which installs its own SIGTERM handler: a TERM stops us as Ctrl-C does
        signal.signal(signal.SIGTERM, _interrupt)
        if prometheus is not None:  # once the app answers, so its first scrapes succeed
            prometheus.start()
        print(json.dumps({"url": server.url, "openai_base_url": server.url + "/v1", "replicas": config.replicas}),
              flush=True)
        if prometheus is not None:
            print(f"prometheus: {prometheus.url}", flush=True)
            print(f"Prometheus scrapes {prometheus.target} with deploy/prometheus/rules; alerts at "
                  f"{prometheus.url}/alerts", file=sys.stderr)
        print("serving; Ctrl-C to stop", file=sys.stderr)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    except MonitoringError as exc:
        print(f"kvflow-ray serve: --with-monitoring: {exc}", file=sys.stderr)
        status = 1
    finally:
        if prometheus is not None:
            prometheus.stop()
        with stdout_to_stderr():
            server.stop()
    return status

