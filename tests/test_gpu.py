"""The engine on any torch device (docs/gpu.md): the attention a GPU runs, checked against the CPU path
on the CPU; the device setting; the Llama-3.1-8B-shaped random model; the copy stream and its events on
a CUDA build (skipped where no GPU is visible); and `deploy/gpu-bench.sh --quick --device cpu` end to
end, so the script a GPU machine runs cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from queue import Queue

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvflow_ray.engines.cpu.config import ModelConfig, check_device  # noqa: E402
from kvflow_ray.engines.cpu.kv_pool import CopyJob, CopyStream, KVPool  # noqa: E402
from kvflow_ray.engines.cpu.model import (  # noqa: E402
    CpuModel,
    _gathered_prefill_attention,
    _prefill_attention,
    resolve_device,
)
from kvflow_ray.engines.sim.profile import load_profile  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = "no CUDA GPU is visible to torch here: the copy stream and its events run only on one"


@pytest.mark.parametrize("past", [0, 40])
@pytest.mark.parametrize("runs", [[(10, 85)], [(10, 40), (50, 60), (70, 85)]])
def test_the_gathered_prefill_attention_a_gpu_runs_equals_the_cpu_path(past: int, runs: list[tuple[int, int]]) -> None:
    """Past and chunk gathered, one bottom-right causal pass (GQA 8:2), against the CPU path that attends
    run by run and merges by log-sum-exp: the same outputs and log-sum-exps."""
    g = torch.Generator().manual_seed(past + len(runs))
    k, v = torch.randn(2, 100, 64, generator=g), torch.randn(2, 100, 64, generator=g)
    context = sum(hi - lo for lo, hi in runs)
    q = torch.randn(8, context - past, 64, generator=g)
    close = {"atol": 1e-4, "rtol": 1e-4}  # float32, sums in different orders
    want, want_lse = _prefill_attention(q, k, v, runs, past, None, with_lse=True)
    got, got_lse = _gathered_prefill_attention(q, k, v, runs, None, with_lse=True)
    fused, none = _gathered_prefill_attention(q, k, v, runs, 0.1, with_lse=False)
    assert want_lse is not None and got_lse is not None and none is None
    torch.testing.assert_close(got, want, **close)
    torch.testing.assert_close(got_lse, want_lse, **close)
    torch.testing.assert_close(fused, _prefill_attention(q, k, v, runs, past, 0.1)[0], **close)


def test_the_device_setting_is_checked_and_auto_follows_what_torch_sees() -> None:
    for good in ("auto", "cpu", "cuda", "cuda:1"):
        check_device(good)
    for bad in ("tpu", "cuda:x", "cpu:0", ""):
        with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
            ModelConfig(device=bad)
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            resolve_device("cuda")


def test_random_8b_is_shaped_like_llama_3_1_8b() -> None:
    config = ModelConfig.named("random-8b", seed=3)
    assert (config.n_layers, config.hidden_size, config.n_heads, config.n_kv_heads, config.intermediate_size,
            config.dtype, config.seed) == (32, 4096, 32, 8, 14336, "bfloat16", 3)
    # KV bytes per token as the simulator's Llama-3.1-8B profiles count them: 128 KiB
    head_dim = config.hidden_size // config.n_heads
    assert config.n_layers * config.n_kv_heads * head_dim * 2 * 2 == load_profile("a10g-llama3.1-8b").kv_bytes_per_token
    assert ModelConfig.named("random", dtype=None) == ModelConfig()
    assert ModelConfig.named("smollm2-135m", dtype="bfloat16").dtype == "bfloat16"


def test_a_host_pool_is_pinned_only_beside_a_gpu() -> None:
    model = CpuModel(ModelConfig(device="cpu"))
    host = model.host_pool("host", 16)
    assert host.device.type == "cpu" and not host.k.is_pinned()
    assert model.pool("device", 16).device == model.device


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_cuda_copies_run_on_the_copy_stream_after_the_compute_before_them() -> None:
    device = torch.device("cuda")
    pools = {"device": KVPool("device", 64, 2, 2, 8, torch.bfloat16, device),
             "host": KVPool("host", 64, 2, 2, 8, torch.bfloat16, pinned=True)}
    assert pools["host"].k.is_pinned()
    pools["device"].k.normal_()
    pools["device"].v.normal_()
    done: Queue[CopyJob] = Queue()
    stream = CopyStream("test", None, done)
    try:
        src, dst = pools["device"].alloc(16), pools["host"].alloc(16)
        stream.submit(CopyJob(pools["device"], src, pools["host"], dst, lambda: None))
        job = done.get(timeout=30)
        assert isinstance(job.after, torch.cuda.Event) and job.after.query()
        assert stream.cuda_stream is not None and stream.cuda_stream != torch.cuda.current_stream(device)
        torch.testing.assert_close(pools["host"].k[:, :, dst], pools["device"].k[:, :, src.to(device)].cpu())
        back = pools["device"].alloc(16)
        stream.submit(CopyJob(pools["host"], dst, pools["device"], back, lambda: None, speculative=True))
        done.get(timeout=30)
        torch.testing.assert_close(pools["device"].v[:, :, back.to(device)], pools["device"].v[:, :, src.to(device)])
    finally:
        stream.close()


def test_gpu_bench_runs_end_to_end_on_a_cpu(tmp_path: Path) -> None:
    """What CI runs of the GPU script: every section, lru/hicache/kvflow measured and simulated on the
    profile it calibrated, one JSON written."""
    proc = subprocess.run(["bash", str(ROOT / "deploy" / "gpu-bench.sh"), "--quick", "--device", "cpu", "--out",
                           str(tmp_path), "--no-progress"], capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert report["machine"]["device"] == "cpu" and report["model"]["name"] == "random"
    profile = load_profile(report["profile"]["path"])
    assert profile.name == report["profile"]["name"] == "cpu-random"
    assert profile.gpu_kv_tokens == report["engine"]["device_kv_tokens"]
    for section in ("headline", "concurrent"):
        results = report[section]["results"]
        assert set(results) == {"lru", "hicache", "kvflow"}
        assert results["kvflow"]["recomputed_tokens"] < results["lru"]["recomputed_tokens"]
        assert results["lru"]["loaded_tokens"] == 0 and results["lru"]["load_hidden_fraction"] is None
        for r in results.values():
            assert r["latency_s"] > 0 and r["simulated_latency_s"] > 0 and r["workflows_measured"] > 0
            assert r["sim_over_real"] == pytest.approx(r["simulated_latency_s"] / r["latency_s"])
        assert 0.0 <= results["kvflow"]["load_hidden_fraction"] <= 1.0
    # one workflow at a time: the next agent's prompt is loaded while the current one runs
    assert report["headline"]["results"]["kvflow"]["prefetch_issued"] > 0
    assert "headline:" in proc.stdout and "kvflow" in proc.stdout


def test_gpu_bench_says_what_it_lacks(tmp_path: Path) -> None:
    """An interpreter without torch gets one line naming what the script needs, not a traceback."""
    proc = subprocess.run(["bash", str(ROOT / "deploy" / "gpu-bench.sh"), "--quick"], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHON": "/usr/bin/false"})
    assert proc.returncode == 2 and "needs both" in proc.stderr and "Traceback" not in proc.stderr
