#!/usr/bin/env bash
# GPU smoke: the KVFlow microbenchmark on real SGLang with the kvflow plugin, lru vs hicache vs kvflow,
# on a dummy-weights Llama-3.1-8B (no download). Writes benchmarks/results/sglang_smoke.json and
# prints the same JSON; progress and kvflow's speedups go to stderr.
#
#   deploy/gpu-smoke.sh                       # defaults: 10 agents x 8192 fixed tokens, 1+10 passes
#   deploy/gpu-smoke.sh --iterations 3        # any benchmarks/sglang_smoke.py flag passes through
#   SKIP_INSTALL=1 deploy/gpu-smoke.sh        # kvflow-ray[sglang] is installed already
#
# Needs: a CUDA GPU with ~16 GB for the weights plus the capped KV pool (about 4 GB), ~20 GB of free
# host memory for the HiCache host pool, Python 3.11. The install step needs PyPI: on a host without
# internet, run `pip install -e '.[sglang]'` beforehand (or from a local wheelhouse:
# `pip install --no-index --find-links WHEELS -e '.[sglang]'`) and set SKIP_INSTALL=1.
# The editable install also registers the plugin's 'sglang.srt.plugins' entry point; policy kvflow
# refuses to start without it.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
OUT="${OUT:-benchmarks/results/sglang_smoke.json}"

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-smoke: no NVIDIA GPU visible (nvidia-smi); this smoke test needs one" >&2
    exit 2
fi
nvidia-smi -L >&2

if [ "${SKIP_INSTALL:-0}" != "1" ]; then
    echo "== pip install -e '.[sglang]'" >&2
    "$PYTHON" -m pip install --quiet --disable-pip-version-check -e '.[sglang]'
fi
"$PYTHON" - <<'PY' >&2
import importlib.metadata as md
import sys
try:
    print("sglang", md.version("sglang"))
except md.PackageNotFoundError:
    sys.exit("gpu-smoke: sglang is not installed: pip install -e '.[sglang]' (beforehand when offline)")
if not any(ep.name == "kvflow" for ep in md.entry_points(group="sglang.srt.plugins")):
    sys.exit("gpu-smoke: the kvflow SGLang plugin is not registered: pip install -e '.[sglang]' from this checkout")
PY

# Offline hosts: nothing to download (dummy weights, no tokenizer); do not let HF libraries try.
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}"

mkdir -p "$(dirname "$OUT")"
echo "== benchmarks/sglang_smoke.py -> $OUT" >&2
exec "$PYTHON" benchmarks/sglang_smoke.py --out "$OUT" "$@"
