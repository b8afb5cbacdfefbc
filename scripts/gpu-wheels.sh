#!/usr/bin/env bash
# The wheels deploy/gpu-bench.sh needs on a GPU machine that reaches no package registry: this package's
# dependencies on that script's path that such a machine lacks (pydantic and its own), for the machine's
# Python and platform. Run it where a registry is reachable; bring the folder along (a few MB).
#
#   scripts/gpu-wheels.sh [DIR] [PYTHON_VERSION]     # defaults: deploy/wheels (git ignores it), 3.12
set -euo pipefail
cd "$(dirname "$0")/.."

DIR="${1:-deploy/wheels}"
PY="${2:-3.12}"
mkdir -p "$DIR"
python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    --python-version "$PY" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --implementation cp --dest "$DIR" "pydantic>=2.6"
ls -1 "$DIR"
du -sh "$DIR"
