#!/usr/bin/env bash
# Set up and run the whole test suite: the one test command of the README and of CI (.ci/run).
# Installs what the tests need, so it works on a fresh machine; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet --disable-pip-version-check -e '.[dev]'

echo "== ruff"
python3 -m ruff check kvflow_ray tests benchmarks

echo "== pytest"
python3 -m pytest -q "$@"
