#!/usr/bin/env bash
# Install SGLang 0.5.23 into the current python3 on a CPU-only machine, so tests/sglang runs the
# kvflow SGLang plugin against the REAL SGLang classes (radix caches, scheduler, hook registry).
# scripts/test.sh (CI) runs this; safe to re-run: when everything is in place it prints one line.
#
# Why not `pip install sglang==0.5.23`: its wheel pins torch==2.14.1 (a multi-GB CUDA build), CUDA-only
# kernels (flashinfer, sglang-kernel, ...) and transformers==5.19.0. The cache/scheduler modules the
# plugin hooks import fine without them, so SGLang and the few packages its imports need are installed
# with --no-deps, and torch (2.13.0, the CPU build) and transformers (5.24.0) are never touched.
# torchvision (PyPI's cannot load against the CPU torch) is replaced by a sys.modules stand-in in
# tests/sglang/conftest.py; SGLANG_USE_CPU_ENGINE must stay unset (it makes SGLang import sgl_kernel).
# Details: docs/dev/sglang-plugin.md section 8.
set -euo pipefail

# -qq: errors only (this machine's pip config also names local indexes that are absent, one warning each).
PIP=(python3 -m pip install -qq --disable-pip-version-check)

# Installed with --no-deps at exactly these versions (the set verified with SGLang 0.5.23 on CPU).
# Each one is imported at module level on the way to the classes the plugin uses.
PINNED=(
    sglang==0.5.23
    psutil==7.2.2                       # sglang/srt/utils/common.py
    pybase64==1.5.1                     # sglang/srt/utils/common.py
    triton==3.9.0                       # sglang/srt/utils/common.py and mem_cache/utils.py's kernels (mla_buffer);
                                        #   imports without a GPU (SGLang warns and uses its CPU fallbacks)
    msgspec==0.23.0                     # sglang/srt/platforms/interface.py
    pyzmq==27.3.0                       # sglang/srt/utils/network.py (import zmq)
    dill==0.4.1                         # sglang/srt/sampling/custom_logit_processor.py
    setproctitle==1.3.8                 # sglang/srt/managers/scheduler.py
    partial-json-parser==0.2.1.1.post7  # sglang/srt/function_call (reached from the scheduler)
    einops==0.8.2                       # sglang/srt/eplb/expert_distribution.py
    apache-tvm-ffi==0.1.11              # sglang/kernels/ops/communication/all_reduce.py (import tvm_ffi); SGLang's pin
    sentencepiece==0.2.3                # sglang/srt/configs/internvl.py (SGLang pins 0.2.1; 0.2.3 is the one verified)
    gguf==0.19.0                        # sglang/srt/layers/quantization/gguf.py
    compressed-tensors==0.18.0          # sglang/srt/layers/quantization (SGLang's pin; requires torch, hence --no-deps)
    loguru==0.7.3                       # needed by compressed-tensors (its logger)
    xgrammar==0.2.7                     # sglang/srt/function_call (its tool-call parsers; SGLang's pin, CPU wheel;
                                        #   requires torch, hence --no-deps; the rest it needs is here already)
)
# Needed by SGLang's imports too, but any installed version does: not part of kvflow-ray[dev], so installed
# (at these versions, with their own dependencies, which never include torch) only when missing.
# The versions are those kvflow-ray[dev] installs, so after `pip install -e '.[cpu,test]'` alone the
# same set results (kvflow-ray[serve] and [bench] bring most of them).
PRESENT=(
    orjson==3.8.3                # sglang/srt/utils/common.py
    ipython==8.12.3              # sglang/srt/utils/common.py (IPython.display)
    scipy==1.17.1                # transformers' AutoProcessor, reached from sglang/srt/utils/hf_transformers
    requests==2.34.2             # sglang/srt/utils/common.py
    pillow==13.0.0               # sglang/srt/utils/common.py (PIL)
    starlette==1.10.0            # sglang/srt/utils/common.py
    fastapi==0.165.0             # sglang/srt/managers (the scheduler's imports)
    uvicorn==0.55.0              # sglang/srt/entrypoints, reached from the scheduler
    uvloop==0.23.0               # the same
    aiohttp==3.14.5              # sglang/srt/utils/common.py
    openai==3.57.0               # sglang/srt/entrypoints/openai protocol, reached from the scheduler
    prometheus_client==0.26.0    # sglang/srt/metrics
)

# What is missing or at another version; also checks torch/transformers. One python start, no imports.
check() {
    python3 - "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

def installed(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None

torch, transformers = installed("torch"), installed("transformers")
if torch is None or torch.split("+")[0] != "2.13.0" or (("+" in torch) and not torch.endswith("+cpu")):
    sys.exit(f"install-sglang-cpu: needs torch 2.13.0 (the CPU build), found {torch}; "
             "install the project first: python3 -m pip install -e '.[dev]'")
if "+" not in torch:  # 2.13.0 without a local label: only the CUDA build on PyPI is named like this
    import torch as t
    if t.version.cuda is not None:
        sys.exit(f"install-sglang-cpu: torch {torch} is a CUDA build (cuda {t.version.cuda}); needs 2.13.0+cpu")
if transformers != "5.24.0":
    sys.exit(f"install-sglang-cpu: needs transformers 5.24.0, found {transformers}; "
             "install the project first: python3 -m pip install -e '.[dev]'")
mode, todo = sys.argv[1], []
for spec in sys.argv[2:]:
    name, want = spec.split("==")
    have = installed(name)
    if have is None or (mode == "exact" and have != want):
        todo.append(spec)
print(" ".join(todo))
EOF
}

# Everything is read from the arrays above; comments after the specs are not part of them.
pinned_todo=$(check exact "${PINNED[@]}")
present_todo=$(check present "${PRESENT[@]}")
if [ -z "$pinned_todo" ] && [ -z "$present_todo" ]; then
    echo "== sglang 0.5.23 (CPU recipe) already installed"
    exit 0
fi

start=$SECONDS
# pip's resolver lists every SGLang pin bypassed here as a "dependency conflict": expected, so its output
# goes to a log, summed up in one line (and shown whole if pip fails)
log=$(mktemp /tmp/install-sglang-cpu.XXXXXX.log)
pip_quiet() {
    if ! "${PIP[@]}" "$@" >>"$log" 2>&1; then
        cat "$log" >&2
        echo "install-sglang-cpu: pip failed (log above, also in $log)" >&2
        exit 1
    fi
}
versions() { python3 -c 'from importlib.metadata import version as v; print(v("torch"), v("transformers"))'; }
before=$(versions)
echo "== installing sglang 0.5.23 (CPU recipe):${pinned_todo:+ $pinned_todo}${present_todo:+ $present_todo}"
if [ -n "$pinned_todo" ]; then
    # shellcheck disable=SC2086
    pip_quiet --no-deps $pinned_todo
fi
if [ -n "$present_todo" ]; then
    # With dependencies, but torch and transformers held where they are.
    constraints=$(mktemp)
    trap 'rm -f "$constraints"' EXIT
    read -r torch_v transformers_v <<<"$before"
    printf 'torch==%s\ntransformers==%s\n' "$torch_v" "$transformers_v" >"$constraints"
    # shellcheck disable=SC2086
    pip_quiet -c "$constraints" $present_todo
fi
after=$(versions)
if [ "$before" != "$after" ]; then
    echo "install-sglang-cpu: torch/transformers changed from '$before' to '$after'" >&2
    exit 1
fi
still=$(check exact "${PINNED[@]}")$(check present "${PRESENT[@]}")
if [ -n "$still" ]; then
    echo "install-sglang-cpu: still missing after install: $still" >&2
    exit 1
fi
conflicts=$(grep -c " requires \| has requirement " "$log" || true)
note=""
if [ "$conflicts" -gt 0 ]; then
    note=" ($conflicts SGLang pins bypassed on purpose, as the resolver reports in $log)"
fi
echo "== sglang 0.5.23 (CPU recipe) installed in $((SECONDS - start))s$note"
