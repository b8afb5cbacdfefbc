"""The Serve application: an ingress in front of N engine replicas, and the workflow router actor.

`build_app(args)` is the import path a Ray Serve config file names (`deploy/*.yaml`), so
`serve run deploy/serve-cpu.yaml` and `kvflow-ray serve` deploy the same thing. `LocalServer`
starts local Ray, deploys the app and stops it all again: what `kvflow-ray serve`, `kvflow-ray run`
(without `--url`), the tests and the benchmarks use.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from kvflow_ray.serve.config import REQUEST_ROUTERS, AppConfig

APP_NAME = "kvflow"
# Serve's request router for the ingress deployment: a client's calls (its x-session-id) to one replica
INGRESS_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"


def build_app(args: dict[str, Any] | None = None) -> Any:
    """The application for `serve.run` / a Serve config's `import_path: kvflow_ray.serve.app:build_app`."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvflow_ray.serve.ingress import HttpIngress
    from kvflow_ray.serve.replica import EngineReplica

    config = AppConfig.from_dict(args)
    router_class = REQUEST_ROUTERS[config.request_router]
    router_config = RequestRouterConfig(**({"request_router_class": router_class} if router_class else {}))
    actor_options: dict[str, Any] = {"num_cpus": config.replica_num_cpus}
    if config.replica_num_gpus:
        actor_options["num_gpus"] = config.replica_num_gpus
    replica = serve.deployment(EngineReplica, name="EngineReplica", num_replicas=config.replicas,
                               max_ongoing_requests=config.max_ongoing_requests, ray_actor_options=actor_options,
                               request_router_config=router_config, health_check_period_s=2,
                               graceful_shutdown_timeout_s=5)
    # a workflow client's calls (its session header: the SDK sends the client id) go to one ingress
    # replica, a pure function of the id and the replicas; without the header, any replica
    ingress = serve.deployment(HttpIngress, name="Ingress", num_replicas=config.ingress_replicas,
                               max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0},
                               request_router_config=RequestRouterConfig(request_router_class=INGRESS_ROUTER))
    return ingress.bind(replica.bind(config.to_dict()), config.to_dict())


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send everything written to stdout (file descriptor 1, so Ray's own log forwarding too) to stderr
    meanwhile: a command's stdout then carries only its result, e.g. `--json`."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def say_on_stderr(message: str) -> None:
    """A phase of a command's start-up, as a line on stderr (a terminal or a log alike)."""
    print(message, file=sys.stderr, flush=True)


class LocalServer:
    """Local Ray + the app on 127.0.0.1:`port`, as a context manager."""

    def __init__(self, config: AppConfig | None = None, *, host: str = "127.0.0.1", port: int = 8000,
                 num_cpus: int | None = None) -> None:
        self.config = config or AppConfig()
        self.host, self.port = host, port
        self.num_cpus = num_cpus or os.cpu_count() or 2

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 300.0, say: Callable[[str], None] | None = None) -> LocalServer:
        """Start Ray (unless it runs), Serve and the app, and wait until every replica is ready. `say`
        hears each phase (a line a user sees in a terminal or a log)."""
        import ray
        from ray import serve

        say = say or (lambda message: None)
        started = time.monotonic()
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            say(f"starting Ray ({self.num_cpus} CPUs)")
            ray.init(num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        say(f"starting Ray Serve on {self.url}; deploying {self.config.replicas} {self.config.engine} replicas "
            "and the workflow router")
        serve.start(http_options={"host": self.host, "port": self.port})
        self.deploy(self.config)
        self.wait_ready(timeout_s, say)
        say(f"ready at {self.url} after {time.monotonic() - started:.0f} s")
        return self

    def deploy(self, config: AppConfig) -> None:
        """(Re)deploy the app with `config`; a new router starts with it (its state is per app)."""
        from ray import serve

        from kvflow_ray.serve.router_actor import stop_router

        serve.delete(APP_NAME)
        stop_router()
        self.config = config
        serve.run(build_app(config.to_dict()), name=APP_NAME, route_prefix="/", blocking=False)

    def wait_ready(self, timeout_s: float = 300.0, say: Callable[[str], None] | None = None) -> None:
        """Until /health says every replica has registered with the router (`say` hears each new one)."""
        deadline = time.monotonic() + timeout_s
        seen = -1
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    import json

                    ready = len(json.loads(response.read())["replicas"])
                    if ready != seen and say is not None:
                        say(f"replicas ready: {ready} of {self.config.replicas}")
                    seen = ready
                    if ready >= self.config.replicas:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the app did not become healthy at {self.url} within {timeout_s:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        import ray
        from ray import serve

        from kvflow_ray.serve.router_actor import stop_router

        if not ray.is_initialized():
            return
        if getattr(self, "_owns_ray", False):
            ray.shutdown()  # the local cluster we started, Serve and the router with it
            return
        serve.delete(APP_NAME)  # someone else's cluster: remove only what we deployed
        stop_router()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
