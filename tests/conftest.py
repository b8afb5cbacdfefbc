"""Shared test setup. Hypothesis profiles: CI runs a fixed, reproducible set of examples (a red CI always
reproduces locally with CI=true); developers get fresh random examples on every run. Real services
(redis-server) are started on loopback by session fixtures and stopped after the session."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from redis_proc import RedisProcess

from kvflow_ray.serve.monitoring import LocalPrometheus

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


# ---------------------------------------------------------------------------------------------- SGLang plugin tests
# tests/sglang runs against the real SGLang (scripts/install-sglang-cpu.sh) with a torchvision stand-in in
# sys.modules (tests/sglang/conftest.py). The stand-in must not leak into this suite (transformers probes
# torchvision), so that directory is its own pytest process: collected only when the arguments point inside it.
SGLANG_TESTS = Path(__file__).parent / "sglang"


def _targets_sglang_tests(config: pytest.Config) -> bool:
    sglang_tests = SGLANG_TESTS.resolve()
    for arg in config.args:  # the paths and node ids given (or testpaths when none are)
        target = Path(config.invocation_params.dir, arg.split("::")[0]).resolve()
        if target.is_relative_to(sglang_tests):
            return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path == SGLANG_TESTS and not _targets_sglang_tests(config):
        return True
    return None  # pytest's own rules decide


def pytest_report_header(config: pytest.Config) -> str | None:
    if _targets_sglang_tests(config):
        return None
    return "SGLang plugin tests run separately: pytest tests/sglang (scripts/test.sh runs both)"


# ---------------------------------------------------------------------------------------------- real services
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """Gives a free TCP port on loopback each call (for servers a test starts)."""
    return _free_port


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port, no persistence; stopped after the session.
    scripts/test.sh installs it (apt-get install redis-server)."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: scripts/test.sh installs it (apt-get install redis-server)")
    server = RedisProcess(_free_port(), tmp_path_factory.mktemp("redis"), aof=False).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def prometheus_factory() -> Iterator:
    """Start real Prometheus servers (Debian's `prometheus`, installed by scripts/test.sh) as the product
    runs them (`kvflow-ray serve --with-monitoring`: the repository's config and rules), on free loopback
    ports, each scraping one `host:port` target every second (sending `metrics_token`, when given, as the
    app's /metrics wants it); all are stopped after the session."""
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is not installed: scripts/test.sh installs it (apt-get install prometheus)")
    started: list[LocalPrometheus] = []

    def start(target: str, metrics_token: str | None = None) -> LocalPrometheus:
        server = LocalPrometheus(target, port=_free_port(), scrape_interval="1s", evaluation_interval="1s",
                                 metrics_token=metrics_token)
        started.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.stop()
