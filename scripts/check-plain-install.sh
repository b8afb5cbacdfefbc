#!/usr/bin/env bash
# The README's promise: a plain `pip install -e .` (no extras: no Ray, Redis, torch) runs the simulator,
# the routers included, and `kvflow-ray validate`. Checked in a fresh venv, as a new user would.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$VENV")"' EXIT
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check -e .
"$VENV/bin/kvflow-ray" validate workflows/software_team.yaml >/dev/null
"$VENV/bin/kvflow-ray" sim --scenario fleet --tenants 2 --apps 2 --clients 8 --replicas 2 --policies lru,kvflow \
    --routing workflow,sglang-cache-aware >/dev/null 2>&1
echo "plain install: kvflow-ray validate and sim (routing included) run without extras"
