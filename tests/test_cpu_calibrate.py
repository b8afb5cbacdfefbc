"""Calibration: the CPU engine's measured steps become the simulator's `cpu-reference` profile, which
`kvflow-ray sim` then finds in the user profile directory; a missing profile is a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvflow_ray.commands.bench import fidelity_report  # noqa: E402
from kvflow_ray.engines.cpu.calibrate import PREFILL_GRID, calibrate, write_profile  # noqa: E402
from kvflow_ray.engines.cpu.config import CpuEngineConfig  # noqa: E402
from kvflow_ray.engines.sim.profile import load_profile  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = ["--scenario", "single", "--agents", "3", "--fixed", "300", "--dynamic", "8", "--output", "3",
        "--iterations", "1", "--policies", "lru,hicache,kvflow", "--json"]


def _cli(args: list[str], profiles: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVFLOW_RAY_PROFILES": str(profiles)}
    return subprocess.run([sys.executable, "-m", "kvflow_ray.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def test_missing_cpu_reference_says_how_to_make_it(tmp_path: Path) -> None:
    run = _cli(["sim", *TINY, "--profile", "cpu-reference"], tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert "kvflow-ray bench calibrate" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.slow
@pytest.mark.serial  # the fit is checked against a later run of the engine: both must see the same machine
def test_calibrated_profile_drives_the_simulator(tmp_path: Path) -> None:
    config = CpuEngineConfig(device_kv_tokens=5_000)
    profile = calibrate(config, repeats=1)
    measured = profile["measurements"]
    assert len(measured["prefill"]) == len(PREFILL_GRID) and all(t > 0 for _n, _c, t in measured["prefill"])
    path = write_profile(profile, str(tmp_path / "cpu-reference.yaml"))
    text = path.read_text()
    assert text.startswith("# Cost profile measured by `kvflow-ray bench calibrate`")
    loaded = load_profile(str(path))
    # the simulated device pool is the engine's, and the fit explains the measured steps
    assert loaded.gpu_kv_tokens == config.device_kv_tokens
    # and so is its chunking: chunks beside decodes, a lone prompt's longer step
    assert loaded.chunked_prefill_tokens == config.chunk_tokens
    assert loaded.idle_prefill_tokens == config.idle_chunk_tokens
    assert loaded.attention_mfu > 0 and loaded.peak_flops > 0 and loaded.iteration_overhead_s >= 0
    # (a median, not every step: a timing taken while another process ran is an outlier, not a bad fit)
    ratios = [loaded.step_time([(n, ctx)], []) / seconds for n, ctx, seconds in measured["prefill"]]
    ratios += [loaded.step_time([], [ctx]) / seconds for ctx, seconds in measured["decode"]]
    ratios.sort()
    assert 0.67 < ratios[len(ratios) // 2] < 1.5, ratios
    # prefill cost grows with new tokens and with context, as measured
    assert loaded.step_time([(1024, 1024)], []) > loaded.step_time([(1024, 0)], []) > loaded.step_time([(32, 0)], [])

    # `sim --profile cpu-reference` finds it in the user profile directory
    run = _cli(["sim", *TINY, "--profile", "cpu-reference"], tmp_path)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["profile"] == "cpu-reference"
    assert out["results"]["lru"]["device_kv_tokens"] == config.device_kv_tokens

    # `bench fidelity` runs the engine and the simulator on the same scenario (the profile exists: no recalibration)
    # three measured passes: a pass takes ~50 ms of wall clock, so one stall of the machine would decide it
    run = _cli(["bench", "fidelity", *TINY, "--iterations", "3", "--model", "random", "--device-kv-tokens", "5000"],
               tmp_path)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert set(report["results"]) == {"lru", "hicache", "kvflow"}
    for r in report["results"].values():
        assert r["ratio"] == pytest.approx(r["simulated_latency_s"] / r["measured_latency_s"])
        assert 0.2 < r["ratio"] < 5  # same order: the simulator models what the engine does


def test_fidelity_report_is_simulated_over_measured() -> None:
    measured = {"scenario": "single", "params": {}, "config": {},
                "results": {"lru": {"latency_s": 2.0, "gpu_hit_ratio": 0.0},
                            "kvflow": {"latency_s": 0.5, "gpu_hit_ratio": 0.9}}}
    simulated = {"results": {"lru": {"latency_s": 2.2, "gpu_hit_ratio": 0.0},
                             "kvflow": {"latency_s": 0.4, "gpu_hit_ratio": 0.8}}}
    report = fidelity_report(measured, simulated)
    assert report["results"]["lru"]["ratio"] == pytest.approx(1.1)
    assert report["results"]["kvflow"]["ratio"] == pytest.approx(0.8)
    assert report["results"]["kvflow"]["simulated_gpu_hit_ratio"] == 0.8


def test_flop_rates_fall_back_to_one_rate_where_gemm_and_attention_cannot_be_told_apart() -> None:
    """On a GPU a short chunk's time is mostly launch overhead: where the two-rate fit has no positive
    solution, every FLOP gets the one rate that fits (attention at the GEMM rate), never a failed run."""
    from kvflow_ray.engines.cpu.calibrate import _flop_rates

    two = _flop_rates([(1.0, 0.1, 2.0), (2.0, 0.1, 4.0), (3.0, 0.2, 6.1)])
    assert two is not None and two[0] == pytest.approx(2.0) and two[1] > 0
    assert _flop_rates([(1.0, 1.0, 2.0), (2.0, 2.0, 4.0)]) == pytest.approx((1.0, 1.0))  # collinear
    assert _flop_rates([(1.0, 0.5, 1.0), (1.0, 0.4, 1.2)]) is not None  # a negative attention rate fits best
    assert _flop_rates([(1.0, 0.0, -1.0)]) is None
