#!/usr/bin/env bash
# KVFlow on one GPU with this project's own engine (no SGLang): the paper's single-workflow headline
# (10 agents x 8,192 fixed + 32 dynamic tokens, 32 output, device KV capped as on an A10G) and a
# concurrent-workflows point, lru vs hicache vs kvflow; the engine calibrated into a simulator profile
# (h200-llama3.1-8b on an H200); the simulator on that profile beside the measured runs. Writes one
# JSON, gpu_bench.json, and the profile's YAML into --out. Sized for 8 minutes on an H200 (docs/gpu.md).
#
#   deploy/gpu-bench.sh                          # on a GPU: writes into benchmarks/out
#   deploy/gpu-bench.sh --out "$OUT"             # anywhere else
#   deploy/gpu-bench.sh --quick --device cpu     # the same steps, small, on a CPU (CI runs this)
#   deploy/gpu-bench.sh --wheels DIR ...         # where this package's dependencies' wheels are
#
# Needs only Python 3.11+ with torch and transformers (and numpy, pyyaml, tqdm, which come with them):
# nothing is installed and no registry is reached. The package runs from this checkout (PYTHONPATH);
# its one other dependency on this path, pydantic, is taken from the environment when it is there, else
# from the wheels in --wheels (default deploy/wheels), unpacked into a temporary folder, no pip needed.
# Fetch those wheels on a machine with a registry: scripts/gpu-wheels.sh (Python 3.12, x86_64 Linux).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
WHEELS="deploy/wheels"
ARGS=()
while [ "$#" -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        --wheels=*) WHEELS="${1#--wheels=}"; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exec "$PYTHON" benchmarks/gpu_bench.py --help ;;
        *) ARGS+=("$1"); shift ;;
    esac
done

if ! "$PYTHON" -c "import torch, transformers" 2>/dev/null; then
    echo "gpu-bench: $PYTHON has no torch or transformers; this script needs both" >&2
    exit 2
fi

VENDOR=""
if ! "$PYTHON" -c "import pydantic" 2>/dev/null; then
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "gpu-bench: pydantic is not installed and $WHEELS holds no wheels: run scripts/gpu-wheels.sh $WHEELS" \
             "on a machine with a package registry and bring that folder along (or pass --wheels DIR)" >&2
        exit 2
    fi
    VENDOR="$(mktemp -d)"
    trap 'rm -rf "$VENDOR"' EXIT
    for wheel in "$WHEELS"/*.whl; do
        "$PYTHON" -m zipfile -e "$wheel" "$VENDOR"  # a wheel is a zip of an importable tree
    done
fi

export PYTHONPATH="$PWD${VENDOR:+:$VENDOR}${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" benchmarks/gpu_bench.py ${ARGS[@]+"${ARGS[@]}"}
